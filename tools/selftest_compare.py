#!/usr/bin/env python
"""The comparisons of scripts/gpu_selftest.sh, without torch (each call starts in well
under a second; the script makes a dozen):

    python tools/selftest_compare.py compare REF RUN [--rtol-loss R --rtol-grad R | --bf16]
                                          [--resumed-at N]  RUN started at iteration N
                                          (--bf16: the tolerance bf16_rtol gives)
    python tools/selftest_compare.py learns RUN [--ratio R]  the loss fell; tokens/s, MFU
    python tools/selftest_compare.py near REF RUN [--rel R]  RUN's final loss within R of
                                          REF's (an FP8 run against bf16); tokens/s ratio

Each prints one JSON line and exits 0 (pass) or 1 (fail). REF and RUN are the files
`tools/gpu_selftest.py history` writes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KEYS = ("lm loss", "grad norm", "load_balancing_loss")


def _emit(report: dict, ok: bool) -> int:
    print(json.dumps({**report, "ok": ok}))
    return 0 if ok else 1


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# bf16 keeps 8 significant bits: round-to-nearest changes a value by at most u = 2**-8
# of itself (the unit roundoff).
BF16_UNIT_ROUNDOFF = 2.0 ** -8
# Per metric, the multiple of u one iteration may add (bf16_rtol).
BF16_GROWTH = {"lm loss": 1.0, "grad norm": 4.0, "load_balancing_loss": 4.0}


def bf16_rtol(key: str, k: int) -> float:
    """Relative tolerance between two bf16 runs of one model whose reductions differ in
    order (another layout, another kernel's tiling), k iterations after they last had
    equal weights (k = 1 at the first iteration compared):

        rtol(k) = c * u * k,   u = 2**-8,   c = 1 (lm loss), 4 (grad norm, aux losses)

    At k = 1 both runs start from the same fp32 weights; every bf16 tensor either run
    makes is the exact value rounded once more, by at most u of itself, and the loss (a
    mean over the batch's tokens) moves by at most about u. Each optimizer step then
    turns that gradient difference into a weight difference of the same relative order
    (Adam's update is normalised; --clip-grad bounds it), so the bound grows linearly
    with k. The gradient norm carries the backward's roundings (twice the forward's) and
    is dominated by few large terms: c = 4. The load-balancing loss moves by 1/(T topk)
    for each token whose top-k flips on a near-tie (T = 128 tokens a micro-batch, top-2:
    1/256 = u), so c = 4 allows four such flips a layer and iteration. An fp32 bound
    (1e-4) would fail on rounding alone; a wrong reduction (a missed all-reduce, a
    doubled gradient, a misrouted expert) moves these metrics by tens of percent."""
    if k < 1:
        raise ValueError(f"k counts from 1, got {k}")
    return BF16_GROWTH[key] * BF16_UNIT_ROUNDOFF * k


def _over(diff: float, tolerance: float) -> float:
    """diff / tolerance; a zero tolerance (bitwise) passes zero only."""
    return diff / tolerance if tolerance else (0.0 if diff == 0 else math.inf)


def cmd_compare(opts: argparse.Namespace) -> int:
    """Largest relative difference of each metric, iteration by iteration; with --bf16
    each iteration against its own bf16_rtol (the report gives the largest ratio)."""
    ref, run = _load(opts.ref)["history"], _load(opts.run)["history"]
    start = opts.resumed_at or 1
    ref = {h["iteration"]: h for h in ref if h["iteration"] >= start}
    run = {h["iteration"]: h for h in run}  # a resumed run must not redo earlier ones
    fixed = {"lm loss": opts.rtol_loss, "grad norm": opts.rtol_grad,
             "load_balancing_loss": opts.rtol_grad}
    worst, ratio = {}, {}
    for key in KEYS:
        diffs = [(abs(ref[i][key] - run[i][key]) / max(abs(ref[i][key]), 1e-12),
                  bf16_rtol(key, i - start + 1) if opts.bf16 else fixed[key])
                 for i in ref if i in run and key in ref[i]]
        worst[key] = max(d for d, _ in diffs) if diffs else None
        ratio[key] = max(_over(d, t) for d, t in diffs) if diffs else None
    ok = (set(ref) == set(run) and len(ref) > 0
          and all(ratio[k] is not None and ratio[k] <= 1.0 for k in KEYS
                  if k in ref[min(ref)]))
    return _emit({"ref": opts.ref, "run": opts.run, "iterations": sorted(run),
                  "max_rel_diff": worst, "max_diff_over_tolerance": ratio,
                  "tolerance": "bf16_rtol" if opts.bf16 else fixed}, ok)


def cmd_learns(opts: argparse.Namespace) -> int:
    data = _load(opts.run)
    losses = [h["lm loss"] for h in data["history"]]
    first, last = losses[0], sum(losses[-5:]) / len(losses[-5:])
    throughput = [float(m.group(1)) for line in data["log"]
                  if (m := re.search(r"throughput \(tokens/s\): ([0-9.]+)", line))]
    tflops = [float(m.group(1)) for line in data["log"]
              if (m := re.search(r"TFLOP/s/GPU\): ([0-9.]+)", line))]
    report = {"first_loss": first, "last_loss": last,
              "tokens_per_sec": throughput[-1] if throughput else None,
              "tflops_per_gpu": tflops[-1] if tflops else None}
    if tflops:  # MFU only where there is a GPU (torch is imported only then)
        import torch

        from megamoe.training.metrics import peak_tflops
        peak = peak_tflops(torch.device("cuda"), None) if torch.cuda.is_available() else 0
        report["mfu"] = tflops[-1] / peak if peak else None
    return _emit(report, math.isfinite(last) and last < opts.ratio * first)


def _tail_loss(data: dict) -> float:
    losses = [h["lm loss"] for h in data["history"]]
    return sum(losses[-5:]) / len(losses[-5:])


def _throughput(data: dict) -> Optional[float]:
    rates = [float(m.group(1)) for line in data["log"]
             if (m := re.search(r"throughput \(tokens/s\): ([0-9.]+)", line))]
    return rates[-1] if rates else None


def cmd_near(opts: argparse.Namespace) -> int:
    """RUN's final loss (mean of its last 5 logged) within `--rel` of REF's: an FP8 run
    against the same run in bf16 (issue 32's bound: 2%); tokens/s of both, as a ratio."""
    ref, run = _load(opts.ref), _load(opts.run)
    a, b = _tail_loss(ref), _tail_loss(run)
    speed = (_throughput(ref), _throughput(run))
    report = {"ref_loss": a, "loss": b, "rel": abs(b - a) / abs(a),
              "tokens_per_sec_ratio": speed[1] / speed[0] if all(speed) else None}
    return _emit(report, math.isfinite(b) and report["rel"] <= opts.rel)


def add_commands(sub) -> None:
    """The compare and learns subcommands (tools/gpu_selftest.py offers them too)."""
    c = sub.add_parser("compare")
    c.add_argument("ref")
    c.add_argument("run")
    c.add_argument("--rtol-loss", type=float, default=1e-4)
    c.add_argument("--rtol-grad", type=float, default=1e-3)
    c.add_argument("--resumed-at", type=int, default=None)
    c.add_argument("--bf16", action="store_true",
                   help="tolerance bf16_rtol(metric, iterations since equal weights)")
    near = sub.add_parser("near")
    near.add_argument("ref")
    near.add_argument("run")
    near.add_argument("--rel", type=float, default=0.02)
    learns = sub.add_parser("learns")
    learns.add_argument("run")
    learns.add_argument("--ratio", type=float, default=0.5)


COMMANDS = {"compare": cmd_compare, "learns": cmd_learns, "near": cmd_near}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_commands(p.add_subparsers(dest="cmd", required=True))
    opts = p.parse_args(argv)
    return COMMANDS[opts.cmd](opts)


if __name__ == "__main__":
    sys.exit(main())
