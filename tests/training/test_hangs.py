"""Hangs end: with --distributed-timeout-minutes, a rank stuck outside a collective, a
collective the other ranks never join, a stuck process-group creation or rendezvous, and a
dead peer end every rank with one line naming the operation and the group (no traceback,
non-zero exit), well within the test's own timeout.

Each case starts two real ranks (torchrun's environment variables, gloo) of
tests/training/fault_worker.py, which injects the fault on one rank, with a 3-second
distributed timeout.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

import pytest

from tests.distributed import free_port
from tests.training.test_pretrain import ROOT, TINY_MOE

WORKER = os.path.join(ROOT, "tests", "training", "fault_worker.py")
TIMEOUT_FLAG = "--distributed-timeout-minutes 0.05"  # 3 s


def _launch(fault: str, extra: str = "", world: int = 2, limit: float = 90.0):
    """[(exit code, stderr)] of each rank, and the wall time until every rank ended."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, MEGAMOE_FAULT=fault, RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        argv = [sys.executable, WORKER, *shlex.split(f"{TINY_MOE} --train-iters 6 "
                                                     f"{TIMEOUT_FLAG} {extra}")]
        procs.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    start = time.time()
    try:
        out = [(p.wait(timeout=max(1.0, limit - (time.time() - start))), p.stderr.read())
               for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out, time.time() - start


def _error_line(stderr: str) -> str:
    """The rank's error line; the rank printed no Python traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("pretrain_gpt.py: error:")]
    assert len(lines) == 1, stderr[-3000:]
    assert stderr.rstrip().endswith(lines[0])  # the last thing the rank printed
    return lines[0]


@pytest.mark.slow
def test_a_rank_stuck_outside_a_collective_ends_every_rank():
    """Rank 1 sleeps 10 s before step 3: rank 0 times out in the gradient all-reduce after
    3 s; rank 1, when it wakes, finds its peer gone. Before every group got the flag's
    timeout, the dp group had torch's 30-minute default and rank 0 waited on."""
    out, wall = _launch("stall_step:1:3:10")
    (rc0, err0), (rc1, err1) = out
    assert rc0 == 1 and rc1 == 1
    line0 = _error_line(err0)
    assert "rank 0: all_reduce on the dp group (ranks [0, 1]) timed out" in line0
    assert "--distributed-timeout-minutes 0.05" in line0 and "grads.py" in line0
    assert "rank 1: all_reduce on the dp group (ranks [0, 1]) lost a peer" in \
        _error_line(err1)
    assert wall < 60


def test_a_stuck_process_group_creation_ends_with_the_group_named():
    out, _ = _launch("stall_mesh:1:0:8")
    (rc0, err0), (rc1, err1) = out
    assert rc0 == 1 and rc1 == 1
    line0 = _error_line(err0)
    assert "rank 0: creating the" in line0 and "group (ranks [0, 1]) timed out" in line0
    assert "mesh.py" in line0
    assert "rank 1: creating the" in _error_line(err1)


@pytest.mark.slow
def test_a_collective_the_other_ranks_never_join_times_out_on_both():
    out, _ = _launch("extra_allreduce:1:3:0")
    (rc0, err0), (rc1, err1) = out
    assert rc0 == 1 and rc1 == 1
    assert "rank 0: all_reduce on the dp group (ranks [0, 1]) timed out" in _error_line(err0)
    assert "rank 1: all_reduce on the world group (2 ranks) timed out" in _error_line(err1)


@pytest.mark.slow
def test_a_rank_that_never_joins_the_rendezvous():
    out, _ = _launch("stall_init:1:0:8")
    (rc0, err0), (rc1, err1) = out
    assert rc0 == 1 and rc1 == 1
    assert "rank 0: the rendezvous (store at 127.0.0.1:" in _error_line(err0)
    assert "timed out" in _error_line(err0)
    assert "rank 1: the rendezvous" in _error_line(err1)


@pytest.mark.slow
def test_a_dead_rank_is_reported_by_its_peer():
    out, _ = _launch("die_step:0:3:0")
    (rc0, _err0), (rc1, err1) = out
    assert rc0 == 9 and rc1 == 1
    assert "rank 1: all_reduce on the dp group (ranks [0, 1]) lost a peer" in \
        _error_line(err1)
