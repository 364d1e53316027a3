"""Smoke tests: tools/bench_train_step.py and tools/profile_step.py run end to end and print
their JSON; the profile accounts for the step (its categories sum to the profiled time)
and finds the categories a MoE step must have."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tool: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), "--json",
                          "--threads", "1", *args], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout[out.stdout.index("{"):])


@pytest.mark.slow
def test_bench_train_step_json():
    r = _run("bench_train_step.py", "--rounds", "1", "--iters", "1", "--warmup", "1")
    assert set(r["best_median_step_s"]) == {"megamoe", "transformers"}
    assert r["floor_s"] > 0 and r["speedup_vs_transformers"] > 0
    assert r["step_gemm_gflop"] > 20  # 6 x matmul weights x 1024 tokens + attention


@pytest.mark.slow
def test_profile_step_accounts_for_the_step():
    r = _run("profile_step.py", "--steps", "1", "--warmup", "1")
    cats = r["categories_s"]
    assert abs(sum(cats.values()) - r["profiled_step_s"]) <= 0.02 * r["profiled_step_s"]
    for must in ("attention", "dense_gemm", "expert_gemm", "router", "permute", "norms",
                 "optimizer", "loss"):
        assert cats[must] > 0, (must, cats)
    assert cats["expert_gemm"] > cats["router"]
    # the backward's operators reach their forward's category (autograd sequence numbers)
    assert cats["other"] < 0.05 * r["profiled_step_s"], cats
    assert r["floor"]["floor_s"] > 0
