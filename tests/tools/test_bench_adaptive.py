"""Smoke test: the adaptive-parallelism sweep runs on 2 gloo ranks at a tiny shape, every
mode agrees with "ep", and the JSON names the automatic choice per token count."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_adaptive_tiny_json():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_adaptive.py"),
                          "--json", "--world-size", "2", "--num-experts", "4",
                          "--hidden-size", "16", "--ffn-hidden-sizes", "32", "--tokens", "8,64",
                          "--repeats", "1", "--timeout", "120"],
                         capture_output=True, text=True, timeout=180, check=True)
    result = json.loads(out.stdout)
    assert [r["tokens_per_rank"] for r in result["rows"]] == [8, 64]
    for row in result["rows"]:
        assert set(row["ms"]) == {"ep", "dp", "tp", "auto"}
        assert row["auto_mode"] in ("ep", "dp", "tp")
        assert row["max_abs_diff_vs_ep"] <= 1e-5
    assert set(result["link_costs"]) == {"all_gather", "all_to_all", "reduce_scatter", "copy"}
    assert set(result["summary"]) == {"auto_never_slower_than_worst", "auto_within_10pct_of_best",
                                      "chosen_mode_within_10pct_of_best"}


def test_bench_adaptive_bad_tokens_flag_is_one_line():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_adaptive.py"),
                          "--tokens", "8,x"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--tokens: expected comma-separated integers" in out.stderr
