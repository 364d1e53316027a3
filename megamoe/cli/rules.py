"""Derived defaults and cross-flag rules for the Megatron-style command line.

Every rule raises `ArgumentError` with one sentence that names the flags involved; the
caller prints it as one line and exits with code 2. Rules run on the parsed namespace
only (sizes come from the environment), before any process group or file is created.
Features that are parsed but not built yet (config/unsupported.py) are rejected here with
"not supported yet".
"""

from __future__ import annotations

import argparse
import ast
import os
from typing import Optional

import torch

from megamoe.cli.compat_args import derive_compat
from megamoe.cli.determinism_args import check_deterministic_mode
from megamoe.cli.fp8_args import check_fp8_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.cli.precision_args import check_precision_args
from megamoe.cli.runhealth_args import check_rerun_mode
from megamoe.cli.tp_comm_args import check_tp_comm_args
from megamoe.cli.unbuilt_args import check_unbuilt
from megamoe.config import ConfigError
from megamoe.config.batch_schedule import parse_step_schedule
from megamoe.config.fields import flag_dest
from megamoe.config.model import check_layer_counts
from megamoe.config.unsupported import NOT_SUPPORTED_YET
from megamoe.data.builder import parse_data_path, parse_split
from megamoe.data.errors import DataError
from megamoe.training.checkpoint.publish import TRACKER


class ArgumentError(ConfigError):
    """A bad flag or flag combination; the message names the flag(s)."""


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_layer_freq(spec: str, num_layers: int) -> list[int]:
    """--moe-layer-freq: an int N (every Nth layer is MoE, starting with layer 0) or a
    Python-like list expression such as "([0]+[1]*23)". Evaluated without eval()."""

    unreadable = ArgumentError(f"--moe-layer-freq: cannot read {spec!r}")
    # A list longer than the model is wrong whatever it holds: stop before building it,
    # so "[1]*100000000000" is one line, not the machine's memory.
    most = max(num_layers, 1)

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add) and type(left) is type(right):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
                seq, times = (left, right) if isinstance(left, list) else (right, left)
                if len(seq) * max(times, 0) > most:
                    raise ArgumentError(f"--moe-layer-freq pattern has {len(seq) * times} "
                                        f"entries but --num-layers is {num_layers}")
                return seq * times
            if isinstance(node.op, ast.Mult) and isinstance(left, int):
                return left * right
        raise unreadable

    try:
        value = ev(ast.parse(spec.strip(), mode="eval"))
    except ArgumentError:
        raise
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise unreadable from None
    if isinstance(value, int):
        if value < 1:
            raise ArgumentError(f"--moe-layer-freq must be >= 1, got {value}")
        return [1 if i % value == 0 else 0 for i in range(num_layers)]
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise ArgumentError(f"--moe-layer-freq pattern must be a list of 0/1, got {spec!r}")
    if len(value) != num_layers:
        raise ArgumentError(
            f"--moe-layer-freq pattern has {len(value)} entries but --num-layers is {num_layers}")
    return value


def _require(args: argparse.Namespace, *flags: str) -> None:
    for flag in flags:
        if getattr(args, flag_dest(flag)) is None:
            raise ArgumentError(f"{flag} is required")


def _derive_defaults(args: argparse.Namespace, world_size: int) -> None:
    """Fill Megatron's derived defaults (they depend on other flags)."""
    args.world_size = world_size
    derive_compat(args)
    # Megatron's validate_args: the deprecated spelling of --apply-wd-to-qk-layernorm
    if args.no_weight_decay_cond_type == "apply_wd_to_qk_layernorm":
        args.apply_wd_to_qk_layernorm = True
    if args.num_attention_heads < 1:  # (the defaults below divide by it)
        raise ArgumentError(f"--num-attention-heads must be positive, got "
                            f"{args.num_attention_heads}")
    if args.num_experts == 0:
        args.num_experts = None
    if args.ffn_hidden_size is None:
        if args.swiglu:  # keep SwiGLU FLOPs equal to a 4h GELU MLP, rounded to 64
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads == 0:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.tensor_model_parallel_size == 1 and args.sequence_parallel:
        args.sequence_parallel = False  # as Megatron: SP is meaningless without TP
    model_parallel = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                      * args.context_parallel_size)
    args.data_parallel_size = world_size // model_parallel if model_parallel else 0
    if args.step_batch_size_schedule is not None:
        _derive_from_step_schedule(args)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.lr_decay_iters is None and args.train_iters:  # (0 / None: nothing decays)
        args.lr_decay_iters = args.train_iters
    if args.moe_router_dtype is None:
        args.moe_router_dtype = "fp32"
    if args.fp16 and not args.loss_scale:  # as Megatron: with dynamic loss scaling a
        args.check_for_nan_in_loss_and_grad = False  # NaN/Inf grad is the scaler's signal
    if args.position_embedding_type == "learned_absolute" and not args.add_position_embedding:
        args.position_embedding_type = "none"
    _derive_moe_defaults(args)
    _derive_recompute_defaults(args)


def _derive_recompute_defaults(args: argparse.Namespace) -> None:
    """Megatron's deprecated spellings: --recompute-activations is selective granularity;
    --moe-layer-recompute is selective with "moe" added to the modules (which default to
    core_attn first, so Megatron recomputes both)."""
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            raise ArgumentError("--recompute-activations means --recompute-granularity "
                                "selective: it cannot be combined with full")
        args.recompute_granularity = "selective"
    if args.moe_layer_recompute:
        if args.recompute_granularity == "full":
            raise ArgumentError("--moe-layer-recompute cannot be combined with "
                                "--recompute-granularity full")
        args.recompute_granularity = "selective"
        given = args.recompute_modules
        modules = list(given) if given is not None else ["core_attn"]
        args.recompute_modules = modules if "moe" in modules else modules + ["moe"]


def _derive_moe_defaults(args: argparse.Namespace) -> None:
    """One --moe-aux-loss-coeff serves every balancing type; --moe-token-dropping is the
    old spelling of capacity factor 1; --moe-layer-freq becomes the per-layer pattern."""
    args.moe_layer_pattern = None
    if args.num_experts is None:
        return
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    if len(coeffs) == 1 and len(types) > 1:
        args.moe_aux_loss_coeff = coeffs * len(types)
    cf = args.moe_expert_capacity_factor
    if cf is not None and cf < 0:  # Megatron: a negative factor means no capacity (dropless)
        args.moe_expert_capacity_factor = None
    elif cf == 0:  # (the Python API's Tutel-style 0 is not a Megatron meaning)
        raise ArgumentError("--moe-expert-capacity-factor 0 would give every expert no room: "
                            "use a factor > 0, or a negative one for dropless")
    if args.moe_token_dropping and args.moe_expert_capacity_factor is None:
        args.moe_expert_capacity_factor = 1.0
    check_layer_counts(args.num_layers, getattr(args, "mtp_num_layers", None))
    if args.num_layers > 0:
        args.moe_layer_pattern = parse_layer_freq(args.moe_layer_freq, args.num_layers)


def _check_data(args: argparse.Namespace) -> None:
    """Data is needed to train (not for a dry run); every file named must exist. (How the
    data flags fit together is DataConfig's own rule.)"""
    if args.split is not None:
        try:
            parse_split(args.split)
        except DataError as e:
            raise ArgumentError(str(e)) from None
    if args.dry_run:
        return
    if not (args.data_path or args.train_data_path or args.mock_data or args.data_args_path
            or args.per_split_data_args_path):
        raise ArgumentError("one of --data-path, --train-data-path, --data-args-path, "
                            "--per-split-data-args-path or --mock-data is required")
    for flag in ("--data-args-path", "--per-split-data-args-path"):
        path = getattr(args, flag_dest(flag))
        if path is not None and not os.path.isfile(path):
            raise ArgumentError(f"{flag}: file not found: {path}")
    if args.tokenizer_type is None and not args.mock_data:
        raise ArgumentError("--tokenizer-type is required")
    for flag in ("--tokenizer-model", "--vocab-file", "--merge-file"):
        path = getattr(args, flag_dest(flag))
        if path is not None and not os.path.exists(path):
            raise ArgumentError(f"{flag}: file not found: {path}")
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        values = getattr(args, flag_dest(flag))
        try:
            prefixes = parse_data_path(values)[1] if values else []
        except DataError as e:
            raise ArgumentError(f"{flag}: {e}") from None
        for prefix in prefixes:
            for suffix in (".bin", ".idx"):
                if not os.path.isfile(prefix + suffix):
                    raise ArgumentError(f"{flag}: file not found: {prefix + suffix}"
                                        f"{_prefix_hint(prefix)}")


def _prefix_hint(prefix: str) -> str:
    """A data path is the prefix of a .bin/.idx pair: 'corpus_text_document', not
    'corpus_text_document.bin'."""
    if prefix.endswith((".bin", ".idx")):
        return f" (give the prefix without .bin/.idx: {prefix[:-4]})"
    return ""


def _check_load_is_not_hf(load: Optional[str]) -> None:
    """--load of a Hugging Face model folder (config.json + *.safetensors, no megamoe
    checkpoint) names the converter instead of 'no checkpoint found'."""
    if not load or not os.path.isdir(load) or os.path.exists(os.path.join(load, TRACKER)):
        return
    names = os.listdir(load)
    if "config.json" in names and any(n.endswith(".safetensors") for n in names) and \
            not any(n.startswith("iter_") or n.endswith(".pt") for n in names):
        raise ArgumentError(
            f"--load {load}: a Hugging Face model (config.json, *.safetensors), not a megamoe "
            f"checkpoint; convert it first: python tools/checkpoint/convert.py hf-to-megamoe "
            f"--input {load} --output DIR, then --load DIR")


def _check_fsdp(args: argparse.Namespace) -> None:
    """Megatron-FSDP (the DeepSeek-V3 script's FSDP branch) is not built."""
    if args.use_megatron_fsdp:
        raise ArgumentError("not supported yet: --use-megatron-fsdp")
    if args.ckpt_format == "fsdp_dtensor":
        raise ArgumentError("not supported yet: --ckpt-format fsdp_dtensor")


def _check_not_supported(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for flag in NOT_SUPPORTED_YET:
        dest = flag_dest(flag)
        value, default = getattr(args, dest), parser.get_default(dest)
        if value != default:
            raise ArgumentError(f"not supported yet: {flag}")
    if (args.profile and not args.use_pytorch_profiler and not args.dry_run
            and not torch.cuda.is_available()):
        raise ArgumentError("--profile without --use-pytorch-profiler is an nsys capture range "
                            "(cudaProfilerStart): it needs CUDA")
    if args.attention_backend == "fused" and not args.dry_run and not torch.cuda.is_available():
        raise ArgumentError("--attention-backend fused needs a CUDA device (cuDNN / "
                            "memory-efficient SDPA kernels): use flash, unfused or auto")
    # --transformer-impl transformer_engine passes here (--dry-run and the planner size
    # the same layers); what a run cannot build with it yet is refused by
    # model/te/support.py (cli/main.py), before any process group exists.


def _check_loss_scale(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse, in one line, the loss-scaling flags Megatron would read nowhere in this run:
    --loss-scale without --fp16 / --bf16 / --use-distributed-optimizer (Megatron's FP32
    optimizer has no scaler), and a dynamic scaler's flag without dynamic scaling."""
    if args.loss_scale and not (args.fp16 or args.bf16 or args.use_distributed_optimizer):
        raise ArgumentError("--loss-scale needs --fp16, --bf16 or --use-distributed-optimizer "
                            "(Megatron's fp32 optimizer has no loss scale)")
    if args.fp16 and not args.loss_scale:
        return
    for flag in ("--initial-loss-scale", "--min-loss-scale", "--loss-scale-window",
                 "--hysteresis"):  # the dynamic scaler's
        dest = flag.lstrip("-").replace("-", "_")
        if getattr(args, dest) != parser.get_default(dest):
            why = "--loss-scale gives a constant scale" if args.fp16 else "it needs --fp16"
            raise ArgumentError(f"{flag} sets the dynamic loss scaler, which this run does "
                                f"not have ({why})")


def _check_required(args: argparse.Namespace) -> None:
    """What a training launch must say (a dry run or --skip-train needs less), then the
    values the configs take in place of "not given"."""
    training = not args.skip_train and not args.dry_run
    if args.train_iters is not None and args.train_samples is not None:
        raise ArgumentError("--train-iters and --train-samples are mutually exclusive")
    if training and args.train_iters is None and args.train_samples is None:
        raise ArgumentError("one of --train-iters or --train-samples is required")
    if training and args.lr is None:
        raise ArgumentError("--lr is required")
    if args.logging_level is not None and args.logging_level < 0:
        raise ArgumentError(f"--logging-level must be >= 0, got {args.logging_level}")
    if args.train_iters is not None and args.train_iters < 0:
        raise ArgumentError(f"--train-iters must be >= 0, got {args.train_iters}")
    if args.train_samples is None:  # with --train-samples the iterations are derived
        args.train_iters = args.train_iters or 0
    if args.lr is None:  # no update is made: any rate the other LR flags allow
        args.lr = max(0.0, args.min_lr, args.lr_warmup_init)


def _derive_from_step_schedule(args: argparse.Namespace) -> None:
    """Megatron's rules: the schedule replaces --global-batch-size (its last size is the
    run's), and --rampup-batch-size, which Megatron ignores, cannot join it."""
    if args.global_batch_size is not None:
        raise ArgumentError("cannot specify both --step-batch-size-schedule and "
                            "--global-batch-size")
    if args.rampup_batch_size is not None:
        raise ArgumentError("cannot specify both --step-batch-size-schedule and "
                            "--rampup-batch-size (Megatron ignores the latter)")
    if args.seq_length is not None and args.seq_length > 0:
        args.global_batch_size = parse_step_schedule(args.step_batch_size_schedule,
                                                     args.seq_length)[-1][1]


def finalize_args(args: argparse.Namespace, parser: argparse.ArgumentParser,
                  world_size: Optional[int] = None) -> argparse.Namespace:
    """Derive Megatron's defaults, check what only the command line knows (required flags,
    files, features not built yet), then build the configs once: their own validation
    checks every value and every cross-feature rule. Raises ConfigError (ArgumentError)
    on the first failure, before any process group or file is created."""
    check_unbuilt(args)  # a Megatron flag megamoe lacks: its own line before any other rule
    _require(args, "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")
    _derive_defaults(args, env_world_size() if world_size is None else world_size)
    _check_required(args)
    check_precision_args(args)
    check_fp8_args(args)
    check_tp_comm_args(args)
    check_rerun_mode(args)
    check_deterministic_mode(args)
    _check_fsdp(args)  # (before the configs, which know no fsdp_dtensor format)
    # No rule depends on the vocabulary, which is known once the tokenizer loads.
    run_config_from_args(args, vocab_size=args.vocab_size or 1)
    _check_data(args)
    _check_load_is_not_hf(args.load)
    _check_not_supported(args, parser)
    _check_loss_scale(args, parser)
    return args
