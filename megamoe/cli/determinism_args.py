"""--deterministic-mode, with Megatron-LM's meaning (megatron/training/arguments.py
validate_args, NVIDIA/Megatron-LM d98e8a64): "choose code that has deterministic
execution". Megatron asserts three things and then calls
`torch.use_deterministic_algorithms(True)`; megamoe refuses the same combinations (one
line, exit 2) and makes the same call before the model is built:

* not with --use-flash-attn (its backward accumulates in an unordered way);
* not with --cross-entropy-loss-fusion (Megatron's fused kernel is not deterministic;
  megamoe runs its own unfused loss for that flag, but keeps Megatron's rule so a script
  that passes here passes there too);
* NCCL_ALGO set to one of Megatron's all-reduce algorithms (NVLS/NVLS-tree reductions
  are not reproducible; NCCL's default may choose them).

Like Megatron, megamoe does not set CUBLAS_WORKSPACE_CONFIG: on CUDA >= 10.2 torch
refuses a cuBLAS matmul under deterministic algorithms without it, naming the variable
(scripts/gpu_selftest.sh sets `:4096:8` for its deterministic run). Under the mode torch
swaps the CUDA `index_add_` / `scatter_add_` megamoe's unpermute uses for deterministic
kernels, so two runs of one layout give the same bits on one machine.
"""

from __future__ import annotations

import argparse
import os

import torch

from megamoe.config import ConfigError

# Megatron's all_reduce_choices for NCCL_ALGO in deterministic mode.
NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def add_determinism_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("determinism (Megatron-LM's)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic kernels only (torch.use_deterministic_algorithms); "
                        "slower, for debugging and testing. Needs NCCL_ALGO in "
                        f"{', '.join(NCCL_ALGOS)}; not with --use-flash-attn or "
                        "--cross-entropy-loss-fusion (Megatron's rules)")


def check_deterministic_mode(args: argparse.Namespace) -> None:
    """Megatron's three assertions, as one-line errors."""
    if not args.deterministic_mode:
        return
    if args.use_flash_attn:
        raise ConfigError("--deterministic-mode: flash attention can not be used in "
                          "deterministic mode (drop --use-flash-attn)")
    if args.cross_entropy_loss_fusion:
        raise ConfigError("--deterministic-mode: cross entropy fusion is not deterministic "
                          "(drop --cross-entropy-loss-fusion)")
    algo = os.environ.get("NCCL_ALGO")
    if algo not in NCCL_ALGOS:
        raise ConfigError(f"--deterministic-mode: the environment's NCCL_ALGO must be one of "
                          f"{', '.join(NCCL_ALGOS)} (got {algo!r})")


def apply_deterministic_mode(enabled: bool) -> None:
    """torch.use_deterministic_algorithms(True), as Megatron's validate_args does: every
    op with a nondeterministic kernel then runs a deterministic one or raises."""
    if enabled:
        torch.use_deterministic_algorithms(True)
