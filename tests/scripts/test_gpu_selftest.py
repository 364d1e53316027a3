"""scripts/gpu_selftest.sh and tools/gpu_selftest.py where there is no GPU: the script
says so in one line and exits 2; its kernel checks run (on the CPU) and meet their own
tolerances; `compare` fails on a perturbed run and on a "resumed" run that redid earlier
iterations; and the whole script rehearses on the CPU (REHEARSAL=2: gloo stands in for
NCCL), so a GPU machine's time is never spent on a broken script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_selftest.sh")
TOOL = os.path.join(ROOT, "tools", "gpu_selftest.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_selftest  # noqa: E402


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_no_gpu_exits_2_with_one_line():
    out = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env=_env())
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in out.stderr


def test_kernel_checks_run_and_pass_on_the_cpu():
    cpu = torch.device("cpu")
    for errors in gpu_selftest._check_grouped_gemm(cpu).values():
        assert all(v < 2e-2 for v in errors.values()), errors
    assert gpu_selftest._flash_attention(cpu) < 2e-2
    assert gpu_selftest._fused_optimizer(cpu) < 1e-5


def _history(path, iterations, scale=1.0):
    hist = [{"iteration": i, "lm loss": 4.0 * scale + i, "grad norm": 1.0 + i,
             "load_balancing_loss": 0.1} for i in iterations]
    path.write_text(json.dumps({"history": hist, "log": []}))
    return str(path)


def _compare(*args: str) -> int:
    return subprocess.run([sys.executable, TOOL, "compare", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT).returncode


def test_te_check_runs_on_the_stand_in():
    """The GPU's Transformer Engine check, on the CPU against TE's stand-in (fp32, the same
    formulas): local and TE agree to fp32 rounding, and a TE path that computed anything
    else would be seen (the check compares logits and every gradient)."""
    from tests.te_stand_in import installed

    with installed():
        report = gpu_selftest.te_parity(torch.device("cpu"), "")
    assert report["logits"] < 1e-5 and report["grads"] < 1e-4, report


@pytest.mark.slow
def test_compare_fails_on_a_perturbed_or_restarted_run(tmp_path):
    ref = _history(tmp_path / "ref.json", range(1, 7))
    assert _compare(ref, _history(tmp_path / "same.json", range(1, 7))) == 0
    assert _compare(ref, _history(tmp_path / "off.json", range(1, 7), 1.001)) == 1
    assert _compare(ref, _history(tmp_path / "short.json", range(1, 6))) == 1
    resumed = _history(tmp_path / "resumed.json", range(4, 7))
    assert _compare(ref, resumed, "--resumed-at", "4") == 0
    assert _compare(ref, _history(tmp_path / "redo.json", range(1, 7)),
                    "--resumed-at", "4") == 1


@pytest.mark.slow
@pytest.mark.timeout(660)  # the script's own limit below is 600 s (nine multi-rank runs)
def test_script_rehearses_every_step_on_the_cpu(tmp_path):
    out = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env=_env(REHEARSAL="2", WORK=str(tmp_path)))
    assert out.returncode == 0, out.stdout + out.stderr
    passed = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("PASS")]
    for name in ("gpu_equals_cpu_fp32", "bf16_learns", "tp2_sp_equals_1gpu",
                 "ep2_alltoall_equals_1gpu", "pp2_interleaved_equals_1gpu",
                 "dp2_distopt_equals_1gpu", "cp2_p2p_equals_1gpu", "cp2_a2a_equals_1gpu",
                 "tp2_resume_equals", "shared_overlap_equals_plain",
                 "ep2_shared_overlap_equals_1gpu"):
        assert name in passed, out.stdout
