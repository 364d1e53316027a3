"""The CP attention benchmark (tools/bench_cp_attention.py) at a short sequence: its JSON
has every entry, the kernel blocks need less transient memory than the explicit blocks
already at 1K tokens (the ratio grows with the length: docs/benchmarks/cp_attention.md),
and a bad flag is one line with exit 2. The 32K manual run is the documented one."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tools import bench_cp_attention as bench


def test_bench_cp_attention_short_sequence():
    args = bench._parser().parse_args(["--seq-length", "1024", "--cp", "2"])
    doc = bench.measure(args, lambda body, world, a: run_distributed(body, world, 120, a)[0])
    row = doc["cp"]["2"]
    for name in ("kernel", "explicit"):
        assert row[name]["seconds"] > 0 and row[name]["peak_bytes_per_rank"] > 0
    # 512 local tokens: one explicit block's fp32 scores alone are 1 MiB; the kernel's
    # whole call holds a few of its [512, 32] tensors and fixed-size tiles
    assert row["explicit_over_kernel_peak"] > 2, row
    assert doc["one_process_sdpa"]["peak_bytes"] > 0


def test_bench_cp_attention_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--seq-length", "1000", "--cp", "3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--seq-length: must be divisible by 2 x every --cp"), err
