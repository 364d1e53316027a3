"""Smoke test: the dispatch benchmark runs on 2 gloo ranks at a tiny shape, prints its JSON,
and every configuration computes the same output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_dispatch_tiny_json():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_dispatch.py"),
                          "--json", "--world-size", "2", "--tokens", "32", "--hidden-size", "16",
                          "--ffn-hidden-size", "32", "--num-experts", "4", "--repeats", "1",
                          "--timeout", "120"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    configs = [(r["dispatcher"], r["overlap_degree"]) for r in report["results"]]
    assert configs == [("allgather", 1), ("alltoall", 1), ("alltoall", 2)]
    for r in report["results"]:
        assert r["ms"] > 0 and r["max_rel_diff_vs_first"] <= 1e-5
