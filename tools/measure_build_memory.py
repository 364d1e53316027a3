#!/usr/bin/env python
"""Host memory one rank needs to build its part of a model: peak RSS against the bytes
of the weights it keeps.

    python tools/measure_build_memory.py --world-size 16 [--rank 0] [--max-ratio 1.3] \
        --config configs/mixtral-8x7b.yaml --vocab-size 32000 \
        --tensor-model-parallel-size 4 --expert-model-parallel-size 4 --sequence-parallel \
        [any other pretrain_gpt.py flag: --use-cpu-initialization, --num-layers 2, ...]

Runs one rank of a `--world-size` launch in this process: a fake process group stands in
for the others (every collective returns at once; nothing here needs their data), the
model is built exactly as pretrain_gpt.py builds it (training/build.py: meta device,
parallelize, materialize) with the CPU as the rank's device, so the resident memory this
process grows by is the memory a GPU rank's host (--use-cpu-initialization) or device
would need. A rank that built the whole single-process model first, as megamoe did before
materialisation, would need `full_model_bytes` (printed for comparison, not built).
Prints one JSON object; exits 1 when `--max-ratio` is given and exceeded.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402  registers "fake"

from megamoe.cli.arguments import parse_args  # noqa: E402
from megamoe.cli.mapping import run_config_from_args  # noqa: E402
from megamoe.model.flops import num_parameters  # noqa: E402
from megamoe.parallel.mesh import build_mesh  # noqa: E402
from megamoe.training.build import build_model  # noqa: E402


def _rss_bytes() -> int:
    """Current resident set size (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _peak_rss_bytes() -> int:
    """This process's own peak RSS: VmHWM of /proc/self/status, which starts afresh at exec.
    (getrusage's ru_maxrss does not: Linux keeps the largest RSS over fork + exec, so a
    launcher holding a GB, such as a pytest worker, would count as this process's peak.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _parse() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--max-ratio", type=float, help="exit 1 above this growth/weights ratio")
    return p.parse_known_args()


def main() -> int:
    opts, flags = _parse()
    # --dry-run lets --vocab-size stand in for a tokenizer file (the rules are the launch's).
    args = parse_args(flags + ["--dry-run"], world_size=opts.world_size,
                      prog="measure_build_memory.py")
    run = run_config_from_args(args, args.vocab_size or 32000)
    dist.init_process_group("fake", store=FakeStore(), rank=opts.rank,
                            world_size=opts.world_size)
    mesh = build_mesh(run.parallel, "fake", torch.device("cpu"))
    gc.collect()
    before = _rss_bytes()
    start = time.perf_counter()
    model = build_model(run, mesh)
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    local = params + sum(b.numel() * b.element_size() for b in model.buffers())
    total, _ = num_parameters(run.model)
    dtype_bytes = 2 if run.optim.bf16 or run.optim.fp16 else 4
    growth = peak - before
    report = {
        "flags": " ".join(flags), "rank": opts.rank, "world_size": opts.world_size,
        "layout": {k: v for k, v in mesh.sizes.items()},
        "dtype": "bf16" if run.optim.bf16 else "fp16" if run.optim.fp16 else "fp32",
        "use_cpu_initialization": run.parallel.use_cpu_initialization,
        "local_parameter_bytes": params, "local_weight_bytes": local,
        "rss_before_build_bytes": before,
        "peak_rss_bytes": peak, "peak_growth_bytes": growth,
        "growth_over_local_weights": round(growth / local, 4),
        "full_model_bytes": total * dtype_bytes,
        "build_seconds": round(seconds, 1),
    }
    print(json.dumps(report))
    dist.destroy_process_group()
    if opts.max_ratio is not None and growth / local > opts.max_ratio:
        sys.stderr.write(f"measure_build_memory.py: growth {growth / local:.3f}x the local "
                         f"weights exceeds --max-ratio {opts.max_ratio}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
