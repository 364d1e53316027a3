"""Megatron-LM flags its own MoE scripts pass that megamoe answers in one of three ways:

* declared equivalents: the flag picks a fused or vendor kernel (Transformer Engine,
  DeepEP/HybridEP, Apex) for math megamoe computes another way. The flag is accepted, the
  flag audit names the reason, and the run prints one line saying what runs instead
  (`declared_equivalents`). Only the flags in EQUIVALENTS may be answered like this.
* deprecated spellings Megatron still accepts: mapped to the current flag, as Megatron's
  validate_args does.
* features megamoe does not have (Megatron-FSDP): parsed so that a script reaches the
  one "not supported yet: --flag" line (config/unsupported.py) instead of argparse's
  "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from megamoe.config import ConfigError
from megamoe.config.model import ATTENTION_BACKENDS
from megamoe.config.train import STRICTNESS

# flag -> what runs in megamoe instead (the line the run prints).
EQUIVALENTS = {
    "--moe-permute-fusion": "the token permutation runs as megamoe's sort-based permute "
                            "(same result as Megatron's fused permute kernels)",
    "--moe-router-fusion": "the router's top-k and scores run as unfused torch ops "
                           "(same result as Megatron's fused router kernels)",
    "--cross-entropy-loss-fusion": "the LM loss runs as megamoe's vocab-parallel cross "
                                   "entropy (same result as the fused kernel)",
    "--te-rng-tracker": "megamoe's own per-parallel-group RNG streams run (no Transformer "
                        "Engine RNG tracker)",
    "--enable-experimental": "megamoe has no experimental code paths behind this switch",
    "--ckpt-fully-parallel-load": "every rank reads its own shards and the tensors it "
                                  "shares with its replicas from storage (DCP); no reads "
                                  "split over data-parallel ranks and exchanged",
    "--moe-token-dispatcher-type flex": "megamoe's alltoall dispatcher runs (flex picks "
                                        "DeepEP/HybridEP/NCCL-EP kernels for the same all-to-all "
                                        "dispatch)",
}
FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """Real features: garbage collection, Python logging, checkpoint loading, attention
    kernels, a tokenizer's own code (their meaning is Megatron-LM's; see each config
    field)."""
    g = parser.add_argument_group("runtime (Megatron-LM's)")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's automatic garbage collector; collect at the "
                        "start, every --manual-gc-interval iterations and around evaluation")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="iterations between collections with --manual-gc (0: never "
                        "during training)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc, no collection around evaluation")
    g.add_argument("--logging-level", type=int, default=None,
                   help="Python logging level of the root logger (e.g. 40 = ERROR; "
                        "MEGATRON_LOGGING_LEVEL in the environment if not given)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="flash / fused (cuDNN or memory-efficient) / unfused (math) / local "
                        "(math) SDPA kernels; auto lets SDPA choose")
    g.add_argument("--local-rank", type=int, default=None,
                   help="the launcher's local rank (torch.distributed.launch passes it); "
                        "must equal LOCAL_RANK, from which this process takes its GPU")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="with --tokenizer-type HuggingFaceTokenizer: run the Python code a "
                        "tokenizer directory names in its tokenizer_config.json auto_map "
                        "(from the directory, never the network; data/remote_tokenizer.py)")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="load whatever format --load holds (needed to load torch_dist "
                        "under --ckpt-format torch)")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected", choices=STRICTNESS,
                   help="torch_dist load: what to do with model keys the checkpoint lacks "
                        "(unexpected) and checkpoint keys the model does not ask for "
                        "(missing)")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations (--profile-step-start, --profile-step-end]: nsys "
                        "capture range (CUDA), or torch.profiler with --use-pytorch-profiler")
    g.add_argument("--use-pytorch-profiler", action="store_true")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="*", default=[0],
                   help="ranks that profile (none given: all)")
    g.add_argument("--record-memory-history", action="store_true",
                   help="CUDA: record the caching allocator's history from before the model "
                        "is built; snapshots at the first iteration and every --log-interval "
                        "(and on OOM) on the --profile-ranks")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle",
                   help="where --record-memory-history writes: <stem>_<rank><ext>")
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="the embedding's rows, fixed (at least the tokenizer's vocabulary, "
                        "divisible by TP) instead of the vocabulary padded to a multiple of "
                        "--make-vocab-size-divisible-by x TP")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated spelling of --position-embedding-type rope")


def add_equivalent_args(parser: argparse.ArgumentParser) -> None:
    """Declared equivalents (--moe-permute-fusion and --moe-token-dispatcher-type are
    parsed with the MoE flags)."""
    g = parser.add_argument_group("accepted kernel choices (declared equivalents)")
    for flag in ("--moe-router-fusion", "--cross-entropy-loss-fusion", "--te-rng-tracker",
                 "--enable-experimental"):
        g.add_argument(flag, action="store_true", help=f"accepted: {EQUIVALENTS[flag]}")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"],
                   help="which fused cross entropy --cross-entropy-loss-fusion picks "
                        "(accepted with it: megamoe's cross entropy runs)")
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="accepted (a no-op): megamoe always builds the model on the meta device")
    g.add_argument("--moe-flex-dispatcher-backend", default="deepep", choices=FLEX_BACKENDS,
                   help="the flex dispatcher's kernels (accepted with "
                        "--moe-token-dispatcher-type flex: the alltoall dispatcher runs)")


def add_refused_args(parser: argparse.ArgumentParser) -> None:
    """Parsed only to be refused with "not supported yet" (config/unsupported.py)."""
    g = parser.add_argument_group("not supported yet")
    for flag in ("--use-megatron-fsdp", "--fsdp-double-buffer", "--use-nccl-ub"):
        g.add_argument(flag, action="store_true", help="not supported yet")
    g.add_argument("--data-parallel-sharding-strategy", default="no_shard",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="Megatron-FSDP's sharding: not supported yet")
    for flag in ("--megatron-fsdp-grad-comm-dtype", "--megatron-fsdp-main-grads-dtype"):
        g.add_argument(flag, default=None, choices=["fp32", "bf16"], help="not supported yet")


def check_local_rank(local_rank: Optional[int]) -> None:
    """--local-rank (Megatron's default: LOCAL_RANK; torch.distributed.launch passes it as
    a flag): megamoe takes the device from LOCAL_RANK (parallel/mesh.py), so the two must
    agree, else the process would run on another GPU than its launcher gave it."""
    if local_rank is None:
        return
    if local_rank < 0:
        raise ConfigError(f"--local-rank must be >= 0, got {local_rank}")
    env = os.environ.get("LOCAL_RANK")
    if env is None and local_rank != 0:
        raise ConfigError(f"--local-rank {local_rank}: LOCAL_RANK is not set, and megamoe "
                          "takes this process's GPU from it (launch with torchrun, which "
                          "sets it)")
    if env is not None and env.strip() != str(local_rank):
        raise ConfigError(f"--local-rank {local_rank} disagrees with LOCAL_RANK={env}")


def derive_compat(args: argparse.Namespace) -> None:
    """Megatron's validate_args steps for these flags: the deprecated RoPE spelling, and
    flex becoming the alltoall dispatcher; `args.declared_equivalents` lists the lines the
    run prints."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    check_local_rank(args.local_rank)
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te":
        raise ConfigError("--cross-entropy-fusion-impl te: Transformer Engine's cross entropy "
                          "fusion is disabled in Megatron-LM (stability); use native")
    lines = [f"{flag}: {EQUIVALENTS[flag]}" for flag in EQUIVALENTS
             if " " not in flag and getattr(args, flag[2:].replace("-", "_"), False)]
    if args.moe_token_dispatcher_type == "flex":
        args.moe_token_dispatcher_type = "alltoall"
        lines.append(f"--moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend "
                     f"{args.moe_flex_dispatcher_backend}): "
                     f"{EQUIVALENTS['--moe-token-dispatcher-type flex']}")
    args.declared_equivalents = lines
