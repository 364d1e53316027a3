"""Megatron-LM's precision-aware optimizer flags (its arguments.py, "Args of
precision-aware optimizer"): same names, choices and defaults. What they do:
training/optim/state_precision.py; their rules: config/optim.py and the one below that
only the command line can see."""

from __future__ import annotations

import argparse

from megamoe.config import ConfigError
from megamoe.config.optim import MAIN_GRADS_DTYPES, MAIN_PARAMS_DTYPES, STATE_DTYPES


def add_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("precision-aware optimizer (Megatron-LM's)")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="store Adam's moments (and main gradients) in the lower precisions "
                        "below; the update still runs in fp32 (needs "
                        "--use-distributed-optimizer)")
    g.add_argument("--main-grads-dtype", default="fp32", choices=MAIN_GRADS_DTYPES,
                   help="dtype the gradients accumulate and are reduced in (bf16 needs --bf16)")
    g.add_argument("--main-params-dtype", default="fp32", choices=MAIN_PARAMS_DTYPES,
                   help="dtype of the main parameters (fp16: not supported yet)")
    g.add_argument("--exp-avg-dtype", default="fp32", choices=STATE_DTYPES,
                   help="storage dtype of Adam's first moment (fp16: with a per-tensor scale; "
                        "fp8: not supported yet)")
    g.add_argument("--exp-avg-sq-dtype", default="fp32", choices=STATE_DTYPES,
                   help="storage dtype of Adam's second moment (as --exp-avg-dtype)")


def check_precision_args(args: argparse.Namespace) -> None:
    """Megatron's validate_args: with --bf16, --accumulate-allreduce-grads-in-fp32 asks for
    fp32 main gradients. --main-params-dtype fp16 (TE's per-tensor-scaled fp16 main
    parameters) is not built: refused, so no config field holds it."""
    if args.main_params_dtype != "fp32":
        if not args.use_precision_aware_optimizer:
            raise ConfigError(f"--main-params-dtype {args.main_params_dtype} needs "
                              "--use-precision-aware-optimizer (without it Megatron keeps "
                              "every optimizer tensor in fp32)")
        raise ConfigError(f"not supported yet: --main-params-dtype {args.main_params_dtype}")
    if args.bf16 and args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype != "fp32":
        raise ConfigError("--main-grads-dtype can only be fp32 when "
                          "--accumulate-allreduce-grads-in-fp32 is set")
