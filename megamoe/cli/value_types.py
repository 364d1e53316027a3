"""Value rules every flag of a type shares, applied by the parser itself: a float flag is
finite, an integer flag fits an int64. Flag-specific ranges live with their config
dataclass; these two catch what no per-flag rule was written for."""

from __future__ import annotations

import argparse
import math

from megamoe.cli.rules import ArgumentError


def finite_float(text: str) -> float:
    """The type of every float flag: a number, and a finite one. An Inf or NaN learning
    rate, clip value or loss coefficient would train (and checkpoint) Inf/NaN weights, and
    NaN passes every range comparison."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def check_int_bounds(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Every integer flag fits an int64: counts, sizes and ids become tensor shapes, numpy
    indices and checkpoint fields, where a larger Python int overflows or allocates
    without end ("--train-iters 100000000000000000000000000")."""
    for action in parser._actions:
        if action.type is not int:
            continue
        value = getattr(args, action.dest, None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and not -2**63 <= v < 2**63:
                raise ArgumentError(f"{action.option_strings[0]} must be below 2**63, got {v}")
