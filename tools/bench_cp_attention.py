"""Context-parallel attention, forward + backward, on gloo ranks of this machine (JSON): the
kernel blocks (parallel/cp_blocks.py, the CPU flash op here) against the explicit fp32
blocks (`explicit_blocks()`: the scores of each block formed as a [B, N, 2c, 2c] matmul,
how every block was computed before the kernels) and against one process running
PyTorch's causal SDPA over the whole sequence. Per rank: peak transient bytes (every CPU
allocation during the op, kernels' scratch included: tools/memory_tracking.allocator_peak;
the largest over the ranks), wall seconds and CPU seconds (the process's own: less
dependent on other load than wall time) of the same run (the slowest rank).

    python tools/bench_cp_attention.py --seq-length 32768 --cp 2 4 \\
        --out docs/benchmarks/cp_attention_32k.json

Inputs are causal, fp32, batch 1, `--heads` query heads of `--head-dim` channels sharing
`--groups` K/V heads, in the load-balanced layout (cp_layout.split_for_cp). Each rank runs
one compute thread; with more ranks than cores the times are oversubscribed (the JSON
notes the cores and load), the bytes are not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe.parallel.context_parallel import cp_attention  # noqa: E402
from megamoe.parallel.cp_blocks import explicit_blocks  # noqa: E402
from tools.memory_tracking import allocator_peak  # noqa: E402

RunRanks = Callable[[Callable, int, argparse.Namespace], Any]  # rank 0's result


def _inputs(args: argparse.Namespace, seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(1, args.heads, seq, args.head_dim), (1, args.groups, seq, args.head_dim),
              (1, args.groups, seq, args.head_dim), (1, args.heads, seq, args.head_dim)]
    return [torch.randn(s, generator=g) for s in shapes]


def _measure(step: Callable[[], None]) -> dict:
    """Seconds and allocator peak of one run (the profiler records a few dozen operator
    and allocation events per block: its cost is small against a block's seconds)."""
    start, cpu = time.perf_counter(), time.process_time()
    peak = allocator_peak(step)
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "peak_bytes": peak}


def _rank_body(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Kernel and explicit blocks on this rank; the slowest time and largest peak over
    the ranks (rank 0 returns them)."""
    import torch.distributed as dist

    from megamoe.parallel.cp_layout import split_for_cp

    q, k, v, dout = (split_for_cp(t, rank, world, dim=2)
                     for t in _inputs(args, args.seq_length))

    def step() -> None:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        cp_attention(*leaves, dist.group.WORLD, "p2p").backward(dout)

    result = {}
    for name in ("kernel", "explicit"):
        if name == "explicit" and args.skip_explicit:
            continue
        if name == "explicit":
            with explicit_blocks():
                got = _measure(step)
        else:
            got = _measure(step)
        stats = torch.tensor([got["seconds"], got["cpu_seconds"], float(got["peak_bytes"])],
                             dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        result[name] = {"seconds": stats[0].item(), "cpu_seconds": stats[1].item(),
                        "peak_bytes_per_rank": int(stats[2])}
    return result


def one_process_sdpa(args: argparse.Namespace) -> dict:
    """PyTorch's causal SDPA over the whole sequence in this process (one thread)."""
    q, k, v, dout = _inputs(args, args.seq_length)
    torch.set_num_threads(1)

    def step() -> None:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(
            *leaves, is_causal=True, enable_gqa=args.heads != args.groups).backward(dout)

    return _measure(step)


def measure(args: argparse.Namespace, run_ranks: RunRanks) -> dict:
    """The JSON document: one entry per CP size and the one-process baseline."""
    per_cp = {str(cp): run_ranks(_rank_body, cp, args) for cp in args.cp}
    for row in per_cp.values():
        if "explicit" in row:
            row["explicit_over_kernel_peak"] = (row["explicit"]["peak_bytes_per_rank"]
                                                / row["kernel"]["peak_bytes_per_rank"])
    return {"seq_length": args.seq_length, "heads": args.heads, "groups": args.groups,
            "head_dim": args.head_dim, "dtype": "float32", "batch": 1,
            "torch": torch.__version__, "cpu_cores": os.cpu_count(),
            "load_average_at_start": list(os.getloadavg()),
            "cp": per_cp, "one_process_sdpa": one_process_sdpa(args)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=32768)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--skip-explicit", action="store_true",
                   help="measure the kernel blocks only (the explicit ones need about "
                        "5 x heads x (S/CP)^2 x 4 bytes per rank)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, help="write the JSON here (else stdout)")
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Ranges, as one line naming the flag (exit 2)."""
    for flag in ("seq_length", "heads", "groups", "head_dim"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: must be at least 1")
    if any(cp < 2 for cp in a.cp):
        p.error("--cp: every size must be at least 2 (the one-process run is the CP=1 case)")
    if any(a.seq_length % (2 * cp) for cp in a.cp):
        p.error("--seq-length: must be divisible by 2 x every --cp")
    if a.heads % a.groups:
        p.error("--heads: must be a multiple of --groups")
    if a.timeout <= 0:
        p.error("--timeout: must be positive")


def main(argv: list[str] | None = None) -> int:
    from tools.gloo_ranks import run_gloo_ranks

    p = _parser()
    a = p.parse_args(argv)
    check_args(p, a)
    doc = measure(a, lambda body, world, args: run_gloo_ranks(
        body, world, args, a.timeout, "bench_cp_attention"))
    text = json.dumps(doc, indent=1)
    if a.out is None:
        print(text)
    else:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
