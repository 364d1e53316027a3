"""Flags megamoe parses (so Megatron-LM scripts are recognised) whose feature is not built
yet. A launch giving one any value other than the parser default fails with "not supported
yet: --flag" (cli/rules.py), and the parallel-layout planner never proposes a layout that
needs one (planning/planner.py). Building a feature means taking its flag off this list:
the command line and the planner then both accept it.

Every other Megatron-LM flag megamoe's parser lacks is in the generated table
config/megatron_unbuilt.txt (refused by cli/unbuilt_args.py); MEGATRON_UNBUILT names them.
"""

from __future__ import annotations

from megamoe.config.megatron_unbuilt import UNBUILT

NOT_SUPPORTED_YET = (
    "--rotary-seq-len-interpolation-factor",
    "--apply-layernorm-1p",
    "--moe-use-legacy-grouped-gemm",
    "--null-tokenizer-pad-id",  # a pad id masked out of the loss (Megatron's GPTDataset)
    # Megatron-FSDP (the DeepSeek-V3 script's FSDP branch); --ckpt-format fsdp_dtensor is
    # refused by value (cli/rules.py)
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "--fsdp-double-buffer",
    "--use-nccl-ub",
    "--megatron-fsdp-grad-comm-dtype",
    "--megatron-fsdp-main-grads-dtype",
    # Transformer Engine's userbuffer settings (--tp-comm-overlap itself is built without
    # userbuffers: cli/tp_comm_args.py)
    "--tp-comm-overlap-cfg", "--tp-comm-bootstrap-backend", "--no-tp-comm-split-ag",
    "--disable-tp-comm-split-ag", "--no-tp-comm-split-rs", "--disable-tp-comm-split-rs",
    # the error injection of Megatron's rerun state machine (--rerun-mode validate_results,
    # not built: cli/runhealth_args.py)
    "--error-injection-rate", "--error-injection-type",
    # FP8 features beyond the recipes (issue 32; cli/fp8_args.py)
    "--fp8-quantizer-factory",
    "--keep-fp8-transpose-cache",
    "--reuse-grad-buf-for-mxfp8-param-ag",
)


MEGATRON_UNBUILT = frozenset(row[0] for row in UNBUILT)


def is_built(flag: str) -> bool:
    """Whether the feature behind `flag` is built (the flag is not refused)."""
    return flag not in NOT_SUPPORTED_YET and flag not in MEGATRON_UNBUILT
