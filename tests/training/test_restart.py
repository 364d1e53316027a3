"""Restart after a dead rank: under `torchrun --max-restarts N` with `--save D --load D`, a
worker killed with SIGKILL makes torchrun restart the group, which resumes from the last
complete checkpoint without a human and ends on the uninterrupted run's losses.

Before the process group was initialised on a store prefix per restart round, the
restarted workers read the failed round's keys from torchrun's store and hung in
process-group creation (static rendezvous and c10d alike, intermittently).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from megamoe.training.checkpoint import read_tracker
from tests.distributed import free_port
from tests.training.test_pretrain import ROOT, TINY_MOE

WORKER = os.path.join(ROOT, "tests", "training", "fault_worker.py")
RUN = "--train-iters 20 --save-interval 5 --distributed-timeout-minutes 0.5"
LOSS = re.compile(r"iteration\s+(\d+)/\s+20 \|.*?lm loss: (\S+) .*?grad norm: (\S+) ")


def _torchrun(rdzv: list[str], save: str, fault: str = "") -> str:
    env = dict(os.environ, MEGAMOE_FAULT=fault, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", *rdzv,
                        "--nnodes", "1", "--nproc_per_node", "2", "--max-restarts", "1",
                        "--monitor-interval", "0.2", WORKER,
                        *shlex.split(f"{TINY_MOE} {RUN} --save {save} --load {save}")],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    return log


def _losses(log: str) -> dict[int, tuple[str, str]]:
    """iteration -> (lm loss, grad norm) as logged; a resumed iteration logged again by
    the restarted group replaces the first (killed) round's line."""
    return {int(i): (loss, norm) for i, loss, norm in LOSS.findall(log)}


def _rendezvous(mode: str) -> list[str]:
    port = str(free_port())
    if mode == "static":
        return ["--master_addr", "127.0.0.1", "--master_port", port]
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"megamoe-{port}"]


@pytest.mark.parametrize("mode", [pytest.param("static", marks=pytest.mark.slow),
                                  pytest.param("c10d", marks=pytest.mark.slow)])
def test_a_killed_worker_restarts_the_group_from_the_last_checkpoint(tmp_path, mode):
    straight = _losses(_torchrun(_rendezvous(mode), str(tmp_path / "straight")))
    assert sorted(straight) == list(range(1, 21))
    save = str(tmp_path / "restarted")
    log = _torchrun(_rendezvous(mode), save, fault="kill_step:1:12:0")
    assert "exitcode: -9" in log or "Signals.SIGKILL" in log, log[-4000:]
    assert f"loaded checkpoint from {save} at iteration 10" in log
    assert _losses(log) == straight  # the uninterrupted run's losses and grad norms
    assert read_tracker(save) == 20
