"""Smoke test: the MoE benchmark runs end to end on its tiny shape and prints its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_tiny_json():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_moe_layer.py"),
                          "--tiny", "--json", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=120, check=True)
    (r,) = json.loads(out.stdout)["results"]
    for key in ("moe_ms", "loop_ms", "einsum_ms", "dense_ms", "ratio_vs_dense",
                "speedup_vs_loop", "speedup_vs_einsum", "peak_mem_ratio_vs_dense"):
        assert r[key] > 0, key
    assert r["shape"] == "tiny" and r["dtype"] == "fp32"
