"""Smoke tests: the dispatch benchmark runs on 2 gloo ranks at a tiny shape, prints its JSON,
and every configuration computes the same output and input gradient. The DeepSpeed-MoE peer
row either runs on the same weights (and then computes the same function) or says why not."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--world-size", "2", "--tokens", "32", "--hidden-size", "16", "--ffn-hidden-size", "32",
        "--num-experts", "4", "--repeats", "1", "--timeout", "120"]


def _run_tiny(*extra: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_dispatch.py"),
                          "--json", *TINY, *extra],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    configs = [(r["dispatcher"], r["overlap_degree"]) for r in report["results"]]
    assert configs == [("allgather", 1), ("alltoall", 1), ("alltoall", 2)]
    for r in report["results"]:
        assert r["ms"] > 0 and r["max_rel_diff_vs_first"] <= 1e-5
        assert r["max_rel_diff_grad_vs_first"] <= 1e-5
    assert [p["name"] for p in report["peers"]] == ["deepspeed.moe.layer.MoE"]
    return report


def _env_without_deepspeed(tmp_path) -> dict:
    """A PYTHONPATH entry whose `deepspeed` fails to import exactly as a missing one does."""
    shim = tmp_path / "deepspeed"
    shim.mkdir()
    (shim / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'deepspeed'\", name='deepspeed')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slow
def test_bench_dispatch_skips_missing_deepspeed(tmp_path):
    report = _run_tiny(env=_env_without_deepspeed(tmp_path))
    assert report["peers"][0] == {
        "name": "deepspeed.moe.layer.MoE",
        "skipped": "deepspeed not installed (scripts/install_bench_peers.sh)"}


@pytest.mark.slow
def test_bench_dispatch_no_deepspeed_flag():
    report = _run_tiny("--no-deepspeed")
    assert report["peers"][0] == {"name": "deepspeed.moe.layer.MoE", "skipped": "--no-deepspeed"}


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed not installed (scripts/install_bench_peers.sh)")
def test_bench_dispatch_deepspeed_peer_tiny():
    peer = _run_tiny()["peers"][0]
    assert "skipped" not in peer, peer
    assert peer["ms"] > 0
    assert set(peer["ms_over_ours"]) == {"allgather", "alltoall", "alltoall_overlap2"}
    # Same router and expert weights, nothing dropped: DeepSpeed computes our function.
    assert peer["max_rel_diff_vs_first"] <= 1e-5
    assert peer["max_rel_diff_grad_vs_first"] <= 1e-5
    assert peer["settings"]["drop_tokens"] is False
    assert peer["settings"]["top2_2nd_expert_sampling"] is False
    # Padding to one capacity: at least the routed rows, C the largest expert load.
    assert peer["expert_rows_per_rank"] == 4 * peer["capacity_per_expert"]
    assert peer["expert_rows_per_rank"] >= peer["routed_rows_per_rank"] == 2 * 32
