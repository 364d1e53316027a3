"""--fp16 and its loss-scaling flags, with Megatron-LM's names, defaults and meaning
(megatron/training/arguments.py `_add_mixed_precision_args`; the scalers themselves are
training/optim/grad_scaler.py).

Megatron builds a loss scaler only for --fp16, --bf16 or --use-distributed-optimizer (a
constant one from --loss-scale; with --fp16 and no --loss-scale a dynamic one) and reads
the dynamic scaler's flags only then. Where Megatron would silently ignore one of these
flags, megamoe refuses it in one line naming the flag (cli/rules.py `_check_loss_scale`:
a flag accepted and ignored would hide a mistake in the launch script;
docs/megatron-semantics.md names the difference).
"""

from __future__ import annotations

import argparse

from megamoe.cli.value_types import finite_float


def add_loss_scale_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision (fp16 loss scaling)")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 model parameters with fp32 main parameters and gradients, "
                        "and loss scaling (dynamic unless --loss-scale)")
    g.add_argument("--loss-scale", type=finite_float, default=None,
                   help="a constant loss scale (with --fp16, --bf16 or "
                        "--use-distributed-optimizer); unset: dynamic with --fp16")
    g.add_argument("--initial-loss-scale", type=finite_float, default=2.0**32,
                   help="the dynamic loss scale's start")
    g.add_argument("--min-loss-scale", type=finite_float, default=1.0,
                   help="the dynamic loss scale's floor")
    g.add_argument("--loss-scale-window", type=finite_float, default=1000.0,
                   help="iterations without overflow before the dynamic scale doubles")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="overflowing iterations before the dynamic scale halves")
