"""Derived defaults and cross-flag rules for the Megatron-style command line.

Every rule raises `ArgumentError` with one sentence that names the flags involved; the
caller prints it as one line and exits with code 2. Rules run on the parsed namespace
only (sizes come from the environment), before any process group or file is created.
Features that are parsed but not built yet are rejected here with "not supported yet".
"""

from __future__ import annotations

import argparse
import ast
import os
from typing import Optional


class ArgumentError(ValueError):
    """A bad flag or flag combination; the message names the flag(s)."""


# Flags parsed (so Megatron scripts are recognised) whose feature is not built yet. Any value
# other than the parser default fails with "not supported yet: --flag".
NOT_SUPPORTED_YET = (
    "--context-parallel-size",
    "--rotary-seq-len-interpolation-factor",
    "--apply-layernorm-1p",
    "--qk-layernorm",
    "--use-flash-attn",
    "--moe-router-force-load-balancing",
    "--moe-use-legacy-grouped-gemm",
    "--moe-permute-fusion",
    "--moe-shared-expert-overlap",
    "--moe-layer-recompute",
    "--rampup-batch-size",
    "--train-samples",
    "--recompute-activations",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--recompute-modules",
    "--fp16",
    "--loss-scale",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--reset-attention-mask",
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_layer_freq(spec: str, num_layers: int) -> list[int]:
    """--moe-layer-freq: an int N (every Nth layer is MoE, starting with layer 0) or a
    Python-like list expression such as "([0]+[1]*23)". Evaluated without eval()."""

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ArgumentError(f"--moe-layer-freq: cannot read {spec!r}")

    try:
        value = ev(ast.parse(spec.strip(), mode="eval"))
    except SyntaxError:
        raise ArgumentError(f"--moe-layer-freq: cannot read {spec!r}") from None
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
        if getattr(args, _dest(flag)) is None:
            raise ArgumentError(f"{flag} is required")


def _derive_defaults(args: argparse.Namespace, world_size: int) -> None:
    """Fill Megatron's derived defaults (they depend on other flags)."""
    args.world_size = world_size
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
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.moe_router_dtype is None:
        args.moe_router_dtype = "fp32"


def _check_model(args: argparse.Namespace) -> None:
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
                 "--seq-length", "--num-query-groups"):
        value = getattr(args, _dest(flag))
        if value is not None and value <= 0:
            raise ArgumentError(f"{flag} must be positive, got {value}")
    if args.hidden_size % args.num_attention_heads != 0:
        raise ArgumentError(
            f"--hidden-size ({args.hidden_size}) must be divisible by "
            f"--num-attention-heads ({args.num_attention_heads})")
    if args.num_attention_heads % args.num_query_groups != 0:
        raise ArgumentError(
            f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
            f"--num-query-groups ({args.num_query_groups})")
    if (args.position_embedding_type == "learned_absolute" and args.add_position_embedding
            and args.seq_length > args.max_position_embeddings):
        raise ArgumentError(
            f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
            f"({args.max_position_embeddings})")
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 are mutually exclusive")
    for flag in ("--hidden-dropout", "--attention-dropout"):
        value = getattr(args, _dest(flag))
        if not 0.0 <= value < 1.0:
            raise ArgumentError(f"{flag} must be in [0, 1), got {value}")


def _check_moe(args: argparse.Namespace) -> None:
    if args.num_experts is None:
        return
    if args.num_experts < 0:
        raise ArgumentError(f"--num-experts must be >= 0, got {args.num_experts}")
    if args.num_experts % args.expert_model_parallel_size != 0:
        raise ArgumentError(
            f"--num-experts ({args.num_experts}) must be divisible by "
            f"--expert-model-parallel-size ({args.expert_model_parallel_size})")
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    pp = args.pipeline_model_parallel_size
    if args.world_size % (etp * ep * pp) != 0:
        raise ArgumentError(
            f"world size {args.world_size} is not divisible by --expert-tensor-parallel-size "
            f"({etp}) x --expert-model-parallel-size ({ep}) x --pipeline-model-parallel-size "
            f"({pp})")
    if etp not in (1, args.tensor_model_parallel_size):
        raise ArgumentError(
            f"not supported yet: --expert-tensor-parallel-size {etp} other than 1 or "
            f"--tensor-model-parallel-size ({args.tensor_model_parallel_size})")
    if args.moe_adaptive_parallelism:
        if ep == 1:
            raise ArgumentError("--moe-adaptive-parallelism needs --expert-model-parallel-size "
                                "> 1 (it switches how the expert-parallel ranks share work)")
        if etp > 1:
            raise ArgumentError("not supported yet: --moe-adaptive-parallelism with "
                                "--expert-tensor-parallel-size > 1 (set it to 1)")
        if args.add_bias_linear:
            raise ArgumentError("not supported yet: --moe-adaptive-parallelism with expert "
                                "biases (add --disable-bias-linear)")
    if etp > 1 and args.moe_ffn_hidden_size % etp:
        raise ArgumentError(
            f"--moe-ffn-hidden-size ({args.moe_ffn_hidden_size}) must be divisible by "
            f"--expert-tensor-parallel-size ({etp})")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise ArgumentError(
            f"--moe-router-topk ({args.moe_router_topk}) must be between 1 and "
            f"--num-experts ({args.num_experts})")
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    if len(coeffs) == 1 and len(types) > 1:
        args.moe_aux_loss_coeff = coeffs = coeffs * len(types)
    if len(coeffs) != len(types):
        raise ArgumentError(
            f"--moe-aux-loss-coeff has {len(coeffs)} values but "
            f"--moe-router-load-balancing-type has {len(types)}")
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ArgumentError(
            "--moe-router-num-groups and --moe-router-group-topk must be given together")
    if groups is not None:
        if args.num_experts % groups != 0:
            raise ArgumentError(
                f"--num-experts ({args.num_experts}) must be divisible by "
                f"--moe-router-num-groups ({groups})")
        if not 1 <= group_topk <= groups:
            raise ArgumentError(
                f"--moe-router-group-topk ({group_topk}) must be between 1 and "
                f"--moe-router-num-groups ({groups})")
        if args.moe_router_topk > group_topk * (args.num_experts // groups):
            raise ArgumentError(
                f"--moe-router-topk ({args.moe_router_topk}) exceeds the experts in the "
                f"selected groups ({group_topk} x {args.num_experts // groups})")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ArgumentError(
            "MoE with --tensor-model-parallel-size > 1 requires --sequence-parallel")
    _check_moe_balancing_and_capacity(args)
    args.moe_layer_pattern = parse_layer_freq(args.moe_layer_freq, args.num_layers)


def _check_moe_balancing_and_capacity(args: argparse.Namespace) -> None:
    types = args.moe_router_load_balancing_type
    known = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
    for kind in types:
        if kind not in known:
            raise ArgumentError(f"--moe-router-load-balancing-type {kind}: choose from "
                                f"{', '.join(known)}")
    if "sinkhorn" in types and args.moe_router_enable_expert_bias:
        raise ArgumentError("--moe-router-load-balancing-type sinkhorn cannot be combined "
                            "with --moe-router-enable-expert-bias")
    if args.moe_router_bias_update_rate < 0:
        raise ArgumentError("--moe-router-bias-update-rate must be >= 0")
    eps = args.moe_input_jitter_eps
    if eps is not None and not 0.0 <= eps < 1.0:
        raise ArgumentError(f"--moe-input-jitter-eps must be in [0, 1), got {eps}")
    if args.moe_token_dropping and args.moe_expert_capacity_factor is None:
        args.moe_expert_capacity_factor = 1.0  # the old spelling's meaning
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        raise ArgumentError("--moe-pad-expert-input-to-capacity needs "
                            "--moe-expert-capacity-factor")
    if args.moe_shared_expert_gate and args.moe_shared_expert_intermediate_size is None:
        raise ArgumentError("--moe-shared-expert-gate needs "
                            "--moe-shared-expert-intermediate-size")
    if args.moe_use_upcycling and args.moe_ffn_hidden_size != args.ffn_hidden_size:
        raise ArgumentError(f"--moe-use-upcycling copies the dense MLP into each expert: "
                            f"--moe-ffn-hidden-size ({args.moe_ffn_hidden_size}) must equal "
                            f"--ffn-hidden-size ({args.ffn_hidden_size})")
    if args.moe_use_upcycling and args.tensor_model_parallel_size > 1:
        raise ArgumentError("not supported yet: --moe-use-upcycling with "
                            "--tensor-model-parallel-size > 1")
    size = args.moe_shared_expert_intermediate_size
    if size is not None and size <= 0:
        raise ArgumentError(f"--moe-shared-expert-intermediate-size must be positive, "
                            f"got {size}")


def _check_tensor_parallel_shapes(args: argparse.Namespace, tp: int) -> None:
    """Every tensor-parallel split must be even; the vocabulary padding must not depend on
    TP (so it is the padding multiple, not the padded size, that TP must divide)."""
    for flag in ("--num-attention-heads", "--num-query-groups", "--ffn-hidden-size",
                 "--make-vocab-size-divisible-by"):
        value = getattr(args, _dest(flag))
        if value % tp:
            raise ArgumentError(f"{flag} ({value}) must be divisible by "
                                f"--tensor-model-parallel-size ({tp})")
    if args.sequence_parallel and args.seq_length % tp:
        raise ArgumentError(f"--seq-length ({args.seq_length}) must be divisible by "
                            f"--tensor-model-parallel-size ({tp}) with --sequence-parallel")


def _check_pipeline(args: argparse.Namespace, pp: int, dp: int) -> None:
    """Layers must split over the (virtual) stages; interleaving needs the micro-batches
    to come in multiples of the pipeline size."""
    from megamoe.model.pipeline_stage import pipeline_layer_ranges

    vp = args.num_layers_per_virtual_pipeline_stage
    if vp is not None and pp == 1:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage needs "
                            "--pipeline-model-parallel-size > 1")
    try:
        pipeline_layer_ranges(args.num_layers, pp, vp, args.decoder_first_pipeline_num_layers,
                              args.decoder_last_pipeline_num_layers)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    micro = args.global_batch_size // max(args.micro_batch_size * dp, 1)
    if vp is not None and micro % pp:
        raise ArgumentError(
            f"--num-layers-per-virtual-pipeline-stage needs the number of micro-batches "
            f"({micro}) to be divisible by --pipeline-model-parallel-size ({pp})")


def _check_parallel_and_batch(args: argparse.Namespace) -> None:
    sizes = {f: getattr(args, _dest(f)) for f in (
        "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
        "--context-parallel-size", "--expert-model-parallel-size",
        "--expert-tensor-parallel-size", "--micro-batch-size")}
    for flag, value in sizes.items():
        if value < 1:
            raise ArgumentError(f"{flag} must be >= 1, got {value}")
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    if args.world_size % (tp * pp * cp) != 0:
        raise ArgumentError(
            f"world size {args.world_size} is not divisible by --tensor-model-parallel-size "
            f"({tp}) x --pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp})")
    if args.expert_model_parallel_size > 1 and args.num_experts is None:
        raise ArgumentError("--expert-model-parallel-size > 1 needs --num-experts")
    if tp > 1:
        _check_tensor_parallel_shapes(args, tp)
    dp = args.data_parallel_size
    _check_pipeline(args, pp, dp)
    if args.global_batch_size % (args.micro_batch_size * dp) != 0:
        raise ArgumentError(
            f"--global-batch-size ({args.global_batch_size}) must be divisible by "
            f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size ({dp})")
    if args.train_iters is None and not args.skip_train and not args.dry_run:
        raise ArgumentError("--train-iters is required")
    if not args.skip_train and not args.dry_run and args.lr is None:
        raise ArgumentError("--lr is required")
    if args.train_iters is not None and args.train_iters < 0:
        raise ArgumentError(f"--train-iters must be >= 0, got {args.train_iters}")
    for flag in ("--log-interval", "--eval-interval"):
        if getattr(args, _dest(flag)) < 1:
            raise ArgumentError(f"{flag} must be >= 1")
    if args.save_interval is not None and args.save_interval < 1:
        raise ArgumentError("--save-interval must be >= 1")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise ArgumentError(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save")
    if args.ckpt_keep_last is not None and args.ckpt_keep_last < 1:
        raise ArgumentError(f"--ckpt-keep-last must be >= 1, got {args.ckpt_keep_last}")
    for flag in ("--ckpt-keep-last", "--async-save"):
        if getattr(args, _dest(flag)) not in (None, False) and args.save is None:
            raise ArgumentError(f"{flag} needs --save")


def _check_data(args: argparse.Namespace) -> None:
    if args.dry_run:
        return
    has_paths = bool(args.data_path) or bool(args.train_data_path)
    if not has_paths and not args.mock_data:
        raise ArgumentError("one of --data-path, --train-data-path or --mock-data is required")
    if has_paths and args.mock_data:
        raise ArgumentError("--mock-data cannot be combined with --data-path")
    if args.data_path and args.train_data_path:
        raise ArgumentError("--data-path and --train-data-path are mutually exclusive")
    if args.tokenizer_type is None:
        if not args.mock_data:
            raise ArgumentError("--tokenizer-type is required")
    needs = {
        "SentencePieceTokenizer": ["--tokenizer-model"],
        "Llama2Tokenizer": ["--tokenizer-model"],
        "HuggingFaceTokenizer": ["--tokenizer-model"],
        "GPT2BPETokenizer": ["--vocab-file", "--merge-file"],
        "NullTokenizer": ["--vocab-size"],
    }.get(args.tokenizer_type, [])
    for flag in needs:
        if getattr(args, _dest(flag)) is None:
            raise ArgumentError(f"--tokenizer-type {args.tokenizer_type} needs {flag}")
    for flag in ("--tokenizer-model", "--vocab-file", "--merge-file"):
        path = getattr(args, _dest(flag))
        if path is not None and not os.path.exists(path):
            raise ArgumentError(f"{flag}: file not found: {path}")
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        for prefix in _data_prefixes(getattr(args, _dest(flag)) or [], flag):
            for suffix in (".bin", ".idx"):
                if not os.path.isfile(prefix + suffix):
                    raise ArgumentError(f"{flag}: file not found: {prefix + suffix}")


def _data_prefixes(values: list[str], flag: str) -> list[str]:
    """Megatron's "p1 p2" or "w1 p1 w2 p2" -> prefixes (weights checked for numbers)."""
    if len(values) < 2:
        return list(values)
    try:
        float(values[0])
    except ValueError:
        return list(values)
    if len(values) % 2:
        raise ArgumentError(f"{flag}: expected weight/prefix pairs, got {len(values)} values")
    for w in values[0::2]:
        try:
            if float(w) < 0:
                raise ArgumentError(f"{flag}: negative weight {w}")
        except ValueError:
            raise ArgumentError(f"{flag}: expected a weight, got {w!r}") from None
    return list(values[1::2])


def _check_not_supported(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for flag in NOT_SUPPORTED_YET:
        dest = _dest(flag)
        value, default = getattr(args, dest), parser.get_default(dest)
        if value != default:
            raise ArgumentError(f"not supported yet: {flag}")
    if args.ckpt_format == "torch" and args.save is not None:
        # the single file holds rank 0's tensors: only layouts where rank 0 has them all
        for size_flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                          "--expert-model-parallel-size"):
            if getattr(args, _dest(size_flag)) > 1:
                raise ArgumentError(f"--ckpt-format torch (single file) cannot save with "
                                    f"{size_flag} > 1: use --ckpt-format torch_dist")
        if args.use_distributed_optimizer and args.data_parallel_size > 1:
            raise ArgumentError("--ckpt-format torch (single file) cannot save with "
                                "--use-distributed-optimizer and data-parallel size > 1: "
                                "use --ckpt-format torch_dist")
    if args.transformer_impl == "transformer_engine":
        raise ArgumentError("not supported yet: --transformer-impl transformer_engine")
    if args.num_experts is not None:
        if args.moe_token_dispatcher_type == "flex":
            raise ArgumentError("not supported yet: --moe-token-dispatcher-type flex")
        overlap = args.moe_a2a_overlap_degree
        if overlap < 1:
            raise ArgumentError(f"--moe-a2a-overlap-degree must be >= 1, got {overlap}")
        if overlap > 1 and (args.moe_token_dispatcher_type != "alltoall"
                            or args.expert_model_parallel_size == 1):
            raise ArgumentError("--moe-a2a-overlap-degree > 1 needs --moe-token-dispatcher-type "
                                "alltoall and --expert-model-parallel-size > 1")
        if args.expert_model_parallel_size > 1 and (
                args.moe_pad_expert_input_to_capacity or args.moe_expert_capacity_factor == 0):
            raise ArgumentError("not supported yet: --moe-pad-expert-input-to-capacity with "
                                "--expert-model-parallel-size > 1")


def finalize_args(args: argparse.Namespace, parser: argparse.ArgumentParser,
                  world_size: Optional[int] = None) -> argparse.Namespace:
    """Derive defaults, then check every rule; raises ArgumentError on the first failure."""
    _require(args, "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")
    _derive_defaults(args, env_world_size() if world_size is None else world_size)
    _check_model(args)
    _check_parallel_and_batch(args)
    _check_moe(args)
    _check_data(args)
    _check_not_supported(args, parser)
    return args
