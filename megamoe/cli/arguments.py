"""Megatron-LM compatible command line: same flag names, meanings and defaults.

A launch script written for Megatron-LM's `pretrain_gpt.py` should run against ours after
changing only paths. Parsing never touches a process group or a file; every cross-flag
rule is checked by `megamoe.cli.rules` right after parsing, so a bad launch fails in
one line before any rank starts work.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn, Optional, Sequence

import yaml

from megamoe.cli.checkpoint_args import CheckpointError, apply_checkpoint_args
from megamoe.cli.ckpt_log_args import CKPT_NO_OPS, add_ckpt_log_args
from megamoe.cli.compat_args import add_equivalent_args, add_refused_args, add_runtime_args
from megamoe.cli.console_args import add_console_args, check_console_args
from megamoe.cli.determinism_args import add_determinism_args
from megamoe.cli.extensions import add_negations, mark_extensions
from megamoe.cli.fp8_args import add_fp8_args
from megamoe.cli.loss_scale_args import add_loss_scale_args
from megamoe.cli.model_optim_args import add_model_optim_args
from megamoe.cli.pipeline_args import add_pipeline_split_args
from megamoe.cli.precision_args import add_precision_args
from megamoe.cli.rules import ArgumentError, finalize_args
from megamoe.cli.runhealth_args import add_runhealth_args
from megamoe.cli.tp_comm_args import add_tp_comm_args
from megamoe.cli.unbuilt_args import add_unbuilt_args
from megamoe.cli.value_types import check_int_bounds, finite_float
from megamoe.config import ConfigError

FUSION_NO_OPS = ("--use-mcore-models", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
                 "--no-bias-dropout-fusion", "--no-rope-fusion",
                 "--no-gradient-accumulation-fusion", "--attention-softmax-in-fp32",
                 "--no-persist-layer-norm")
LOGGING_NO_OPS = ("--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard")
# On/off flags without a negation: accepted no-ops (nothing to undo).
NOT_NEGATED = FUSION_NO_OPS + LOGGING_NO_OPS + CKPT_NO_OPS + (
    "--accumulate-allreduce-grads-in-fp32", "--no-create-attention-mask-in-dataloader")


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):  # noqa: D102 (argparse's)
        args, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}"
                       f"{did_you_mean(unknown, self._option_string_actions)}")
        return args


def did_you_mean(unknown: Sequence[str], known: Sequence[str]) -> str:
    """' (did you mean --hidden-size?)' for the unknown flags close to a known one."""
    flags = [w.split("=", 1)[0] for w in unknown if w.startswith("--")]
    hints = []
    for word in flags:
        close = difflib.get_close_matches(word, known, n=1, cutoff=0.8)
        if close:
            hints.append(f"{word} -> {close[0]}" if len(flags) > 1 else close[0])
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4*hidden, or 8/3*hidden rounded to 64 with --swiglu")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None, help="default hidden/heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--no-position-embedding", dest="add_position_embedding",
                   action="store_false",
                   help="no learned absolute position embedding (implied by rope)")
    g.add_argument("--rotary-base", type=finite_float, default=10000.0)
    g.add_argument("--rotary-percent", type=finite_float, default=1.0)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=finite_float, default=1e-5)
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--qk-layernorm-scope", default="head", choices=["head", "projection"],
                   help="head (Megatron's --qk-layernorm, Qwen3) or "
                        "projection (one norm over the whole q and k projections, OLMoE)")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias in the QKV projection only (Qwen2)")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3 multi-latent attention")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="MLA query latent rank (default: no query compression)")
    g.add_argument("--kv-lora-rank", type=int, default=32)
    g.add_argument("--qk-head-dim", type=int, default=128)
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    g.add_argument("--v-head-dim", type=int, default=128)
    g.add_argument("--rope-type", default=None, choices=["rope", "yarn"],
                   help="MLA's rotary embedding (default yarn)")
    g.add_argument("--rotary-scaling-factor", type=finite_float, default=1.0, help="YaRN factor")
    g.add_argument("--mscale", type=finite_float, default=1.0)
    g.add_argument("--mscale-all-dim", type=finite_float, default=0.0)
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="multi-token prediction depths (DeepSeek-V3 MTP modules)")
    g.add_argument("--mtp-loss-scaling-factor", type=finite_float, default=0.1,
                   help="the MTP loss weight, shared by the depths")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=finite_float, default=0.1)
    g.add_argument("--attention-dropout", type=finite_float, default=0.1)
    g.add_argument("--init-method-std", type=finite_float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", default="local",
                   choices=["local", "transformer_engine"])
    # Megatron flags that only turn off a fused CUDA kernel. megamoe has no fused kernel on
    # these paths, so the unfused math they ask for is what always runs: accepted as-is.
    for flag in FUSION_NO_OPS:
        g.add_argument(flag, action="store_true", help="accepted; the unfused path always runs")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="attention through SDPA's flash kernel only (fails if it cannot run)")


def _add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="None or 0 = dense model")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="default: --tensor-model-parallel-size")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="default: --ffn-hidden-size")
    g.add_argument("--moe-layer-freq", type=str, default="1",
                   help='every Nth layer is MoE (int), or a pattern such as "([0]+[1]*23)"')
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-topk-scaling-factor", type=finite_float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None)
    g.add_argument("--moe-router-group-topk", type=int, default=None)
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"],
                   help="router math dtype (megamoe always computes the router in >= fp32)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=finite_float, default=1e-3)
    g.add_argument("--moe-router-force-load-balancing", action="store_true")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default=["aux_loss"],
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=finite_float, nargs="+", default=[0.0])
    g.add_argument("--moe-z-loss-coeff", type=finite_float, default=None)
    g.add_argument("--moe-input-jitter-eps", type=finite_float, default=None)
    g.add_argument("--moe-expert-capacity-factor", type=finite_float, default=None)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    g.add_argument("--moe-capacity-over-tp-gathered-sequence", action="store_true",
                   help="under TP + SP count capacity over the gathered "
                        "sequence, not over each TP rank's shard (Megatron's)")
    g.add_argument("--moe-expert-bias-counts-before-capacity", action="store_true",
                   help="the expert-bias update counts routed "
                        "assignments before capacity drops, not the kept ones (Megatron's)")
    g.add_argument("--moe-token-dropping", action="store_true",
                   help="old spelling of token dropping (use --moe-expert-capacity-factor)")
    g.add_argument("--moe-token-dispatcher-type", default="allgather",
                   choices=["allgather", "alltoall", "flex"])
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-use-legacy-grouped-gemm", action="store_true")
    g.add_argument("--moe-permute-fusion", action="store_true")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-gate", action="store_true")
    g.add_argument("--moe-shared-expert-overlap", action="store_true")
    g.add_argument("--moe-use-upcycling", action="store_true")
    g.add_argument("--moe-layer-recompute", action="store_true")
    g.add_argument("--moe-per-layer-logging", action="store_true")
    g.add_argument("--moe-a2a-overlap-degree", type=int, default=1)
    g.add_argument("--moe-adaptive-parallelism", action="store_true",
                   help="run each MoE layer call as expert, data or expert-tensor parallel, "
                        "whichever the cost model predicts fastest (needs EP > 1)")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefixes of .bin/.idx files, weighted (w1 p1 w2 p2) or not (p1 p2: "
                        "blended by size, each used once, as Megatron)")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--data-args-path", default=None,
                   help="file holding the --data-path words (for very long blends)")
    g.add_argument("--per-split-data-args-path", default=None,
                   help='JSON {"train": ..., "valid": ..., "test": ...} of per-split blends')
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", default=None,
                   choices=["SentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer",
                            "GPT2BPETokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: ids 0 .. vocab-size - 1 (EOD = vocab-size - 1)")
    g.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                   help="NullTokenizer's EOD id (default: --vocab-size - 1)")
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1,
                   help="NullTokenizer's pad id: -1, no pad token (others not supported yet)")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--dataloader-type", default="single", choices=["single", "cyclic"],
                   help="single: samples in order; cyclic: a new random order every epoch")
    g.add_argument("--no-data-sharding", dest="data_sharding", action="store_false",
                   help="cyclic: shuffle over all samples, not within each rank's bucket")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read .bin files with positioned reads instead of memory-mapping them")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_true",
                   help="accepted; megamoe never materialises attention masks (causal SDPA)")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data-parallel size")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch size from START by INCREMENT over SAMPLES "
                        "samples (needs --train-samples). Megatron ignores it (deprecated); "
                        "megamoe runs it as the equivalent --step-batch-size-schedule")
    g.add_argument("--step-batch-size-schedule", default=None, metavar="SCHEDULE",
                   help='global batch size by tokens consumed, "THRESHOLD:SIZE ..." '
                        '(K/M/B/T suffixes), e.g. "0:768 250B:1536"; replaces '
                        "--global-batch-size")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None,
                   help="train on this many samples (instead of --train-iters)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validate every N iterations (default: only after training)")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--skip-train", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=finite_float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, finish the step, save a checkpoint and exit 0")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="skip steps with a NaN/Inf loss or gradient instead of stopping")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer")
    g.add_argument("--recompute-activations", action="store_true")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", default=None)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accepted; with --bf16 gradients always accumulate in fp32")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="default: nccl on CUDA, gloo otherwise")
    g.add_argument("--distributed-timeout-minutes", type=finite_float, default=10.0)
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default with --overlap-grad-reduce: "
                        "max(40M, 1M x data-parallel size); needs --overlap-grad-reduce)")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="torch.cuda.empty_cache(): 1 after each forward-backward, 2 also "
                        "after each optimizer step")
    g.add_argument("--dry-run", action="store_true",
                   help="validate flags, print model size, and exit before training")


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    o = parser.add_argument_group("optimizer and learning rate")
    o.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    o.add_argument("--lr", type=finite_float, default=None)
    o.add_argument("--min-lr", type=finite_float, default=0.0)
    o.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    o.add_argument("--lr-decay-iters", type=int, default=None)
    o.add_argument("--lr-decay-samples", type=int, default=None,
                   help="with --train-samples (default: --train-samples)")
    o.add_argument("--lr-warmup-iters", type=int, default=0)
    o.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="with --train-samples")
    o.add_argument("--lr-warmup-fraction", type=finite_float, default=None)
    o.add_argument("--lr-warmup-init", type=finite_float, default=0.0)
    o.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    o.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="with --train-samples")
    o.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    o.add_argument("--weight-decay", type=finite_float, default=0.01)
    o.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"],
                   help="weight decay from --start-weight-decay to --end-weight-decay over "
                        "the run (constant: --weight-decay)")
    o.add_argument("--start-weight-decay", type=finite_float, default=None)
    o.add_argument("--end-weight-decay", type=finite_float, default=None)
    o.add_argument("--adam-beta1", type=finite_float, default=0.9)
    o.add_argument("--adam-beta2", type=finite_float, default=0.999)
    o.add_argument("--adam-eps", type=finite_float, default=1e-8)
    o.add_argument("--sgd-momentum", type=finite_float, default=0.9)
    o.add_argument("--clip-grad", type=finite_float, default=1.0)


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-comm-type", nargs="+", default=["p2p"],
                   help="p2p (K/V ring) or allgather; one value or one per layer")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialise the weights in host memory, then copy them to the device "
                        "(same values; more host memory, less device work)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)


def _add_checkpoint_and_logging_args(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("checkpointing")
    c.add_argument("--save", default=None)
    c.add_argument("--load", default=None)
    c.add_argument("--save-interval", type=int, default=None)
    c.add_argument("--no-load-optim", action="store_true")
    c.add_argument("--no-load-rng", action="store_true")
    c.add_argument("--no-save-optim", action="store_true")
    c.add_argument("--no-save-rng", action="store_true")
    c.add_argument("--finetune", action="store_true")
    c.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's shape from the --load checkpoint's saved "
                        "arguments (Megatron-LM's semantics)")
    c.add_argument("--ckpt-format", default="torch_dist",
                   choices=["torch", "torch_dist", "fsdp_dtensor"],
                   help="torch_dist: sharded (DCP), loads into any parallel layout; torch: "
                        "one file written by rank 0 (single-process / data-parallel only); "
                        "fsdp_dtensor (Megatron-FSDP's): not supported yet")
    c.add_argument("--async-save", action="store_true",
                   help="write checkpoints on a background thread (training keeps going)")
    c.add_argument("--ckpt-keep-last", type=int, default=None, metavar="N",
                   help="keep only the newest N checkpoints under --save (default: all)")
    c.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="load iteration N of --load (iter_N) instead of the one "
                        "latest_checkpointed_iteration.txt names")
    c.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="if --load holds no checkpoint, exit instead of starting from "
                        "random weights")

    lg = parser.add_argument_group("logging")
    lg.add_argument("--log-interval", type=int, default=100)
    lg.add_argument("--tensorboard-dir", default=None)
    lg.add_argument("--tensorboard-log-interval", type=int, default=1)
    lg.add_argument("--log-throughput", action="store_true")
    lg.add_argument("--peak-tflops", type=finite_float, default=None,
                    help="peak TFLOP/s of one device, for MFU (default: the bf16 dense peak of a "
                         "known GPU; no MFU on a CPU)")
    lg.add_argument("--log-timers-to-tensorboard", action="store_true",
                    help="write the timers of --timing-log-level to TensorBoard")
    lg.add_argument("--log-params-norm", action="store_true",
                    help="log the L2 norm of all parameters after each step (params norm)")
    lg.add_argument("--log-num-zeros-in-grad", action="store_true",
                    help="log the number of zero gradient elements of each step (num zeros)")
    # These only select which extra scalars go to TensorBoard/W&B; megamoe always writes
    # the timers, memory, validation ppl and learning rate it has.
    for flag in LOGGING_NO_OPS:
        lg.add_argument(flag, action="store_true")


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog=prog, description="megamoe: Megatron-style MoE GPT pretraining",
        allow_abbrev=False)
    _add_model_args(parser)
    add_model_optim_args(parser)
    _add_moe_args(parser)
    _add_data_args(parser)
    _add_training_args(parser)
    _add_optimizer_args(parser)
    add_loss_scale_args(parser)
    _add_parallel_args(parser)
    add_pipeline_split_args(parser)
    _add_checkpoint_and_logging_args(parser)
    add_ckpt_log_args(parser)
    add_runtime_args(parser)
    add_determinism_args(parser)
    add_precision_args(parser)
    add_fp8_args(parser)
    add_tp_comm_args(parser)
    add_equivalent_args(parser)
    add_refused_args(parser)
    add_runhealth_args(parser)
    add_console_args(parser)
    parser.add_argument("--config", metavar="FILE", help="YAML preset of flags (configs/); "
                        "command-line flags override it (--no-X undoes a preset's X: true)")
    add_unbuilt_args(parser)  # last: only what no call above builds
    add_negations(parser, skip=NOT_NEGATED)
    mark_extensions(parser)
    return parser


def config_file_to_argv(path: str) -> list[str]:
    """A YAML preset -> command-line tokens. Keys are flag names (`num-layers` or
    `num_layers`); `true` means a bare flag, `false`/null omit it, lists give several values.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ArgumentError(f"--config: file not found: {path}") from None
    except IsADirectoryError:
        raise ArgumentError(f"--config: {path} is a directory, not a YAML file") from None
    except UnicodeDecodeError:
        raise ArgumentError(f"--config: {path} is not UTF-8 text") from None
    except OSError as e:
        raise ArgumentError(f"--config: cannot read {path} ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ArgumentError(
            f"--config: {path} is not valid YAML ({e.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ArgumentError(f"--config: {path} must map flag names to values")
    tokens: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            tokens.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            tokens += [flag, *map(str, value)]
        else:
            tokens += [flag, str(value)]
    return tokens


def expand_config_file(argv: list[str]) -> list[str]:
    """Replace `--config FILE` with the file's flags, placed first so that flags given on
    the command line override the preset."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    rest: list[str] = []
    preset: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise ArgumentError("--config needs a file")
            preset += config_file_to_argv(argv[i + 1])
            i += 2
            continue
        if a.startswith("--config="):
            preset += config_file_to_argv(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    return preset + rest


def parse_args(argv: Optional[Sequence[str]] = None, *, world_size: Optional[int] = None,
               prog: str = "pretrain_gpt.py") -> argparse.Namespace:
    """Parse and validate; on any bad input print one line and exit with code 2.

    world_size defaults to torchrun's WORLD_SIZE (1 without torchrun); it is read from the
    environment, never from a process group, so rules run before any group exists.
    """
    parser = build_parser(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config_file(argv)
    except ArgumentError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    if args.use_checkpoint_args:
        try:
            apply_checkpoint_args(args, parser)
        except CheckpointError as e:  # a file's problem: one line, exit 1
            sys.stderr.write(f"{parser.prog}: error: {e}\n")
            sys.exit(1)
    try:
        check_int_bounds(args, parser)
        finalize_args(args, parser, world_size=world_size)
        check_console_args(args)
    except ConfigError as e:  # ArgumentError included
        parser.error(str(e))
    return args
