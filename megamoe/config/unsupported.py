"""Flags megamoe parses (so Megatron-LM scripts are recognised) whose feature is not built
yet. A launch giving one any value other than the parser default fails with "not supported
yet: --flag" (cli/rules.py), and the parallel-layout planner never proposes a layout that
needs one (planning/planner.py). Building a feature means taking its flag off this list:
the command line and the planner then both accept it.
"""

from __future__ import annotations

NOT_SUPPORTED_YET = (
    "--rotary-seq-len-interpolation-factor",
    "--apply-layernorm-1p",
    "--moe-router-force-load-balancing",
    "--moe-use-legacy-grouped-gemm",
    "--moe-permute-fusion",
    "--moe-shared-expert-overlap",
    "--fp16",
    "--loss-scale",
    "--initial-loss-scale",  # fp16's dynamic loss scaler
    "--log-timers-to-tensorboard",  # timers (--timing-log-level) are not built
    "--null-tokenizer-pad-id",  # a pad id masked out of the loss (Megatron's GPTDataset)
)


def is_built(flag: str) -> bool:
    """Whether the feature behind `flag` is built (the flag is not refused)."""
    return flag not in NOT_SUPPORTED_YET
