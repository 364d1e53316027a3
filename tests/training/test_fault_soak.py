"""Fault soak (slow): 20 randomised kill/resume cycles across DP=2, EP=2 and TP=2+SP.

Each layout first trains uninterrupted. Then the same run is started again and again from
one --save directory, each time killed (SIGKILL) either at a random training step of a
random rank, or in the middle of a save, parked at a random phase of the publish protocol
(MEGAMOE_CKPT_TEST_PAUSE) and then the whole job killed, as a node dies; after the cycles
a last start trains to the end. Every iteration any of those starts logged, including the
ones redone after a kill, must carry the uninterrupted run's loss and grad norm, and the
last checkpoint is the final iteration. The summary (cycles, kills mid-save, wall time) is
printed as JSON.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from megamoe.training.checkpoint import PAUSE_ENV, read_tracker
from tests.training.test_preemption import _children
from tests.training.test_pretrain import ROOT, TINY_MOE

WORKER = os.path.join(ROOT, "tests", "training", "fault_worker.py")
ITERS, SAVE_EVERY = 12, 2
RUN = f"--train-iters {ITERS} --save-interval {SAVE_EVERY} --ckpt-keep-last 2"
LAYOUTS = {"dp2": "", "ep2": "--expert-model-parallel-size 2",
           "tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel"}
PHASES = ("before_write", "after_write", "after_publish", "after_tracker", "prune")
LOSS = re.compile(r"iteration\s+(\d+)/\s+\d+ \|.*?lm loss: (\S+) .*?grad norm: (\S+) ")
CYCLES = 20


def _launch(layout: str, save: str, env: dict) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", "2", WORKER,
            *shlex.split(f"{TINY_MOE} {RUN} {LAYOUTS[layout]} --save {save} --load {save} "
                         "--distributed-timeout-minutes 0.5")]
    return subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                     OMP_NUM_THREADS="1", **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(log: str) -> list[tuple[int, str, str]]:
    return [(int(i), loss, norm) for i, loss, norm in LOSS.findall(log)]


def _mid_save(layout: str, save: str, it: int, phase: str, marker: str) -> str:
    """Park rank 0's save of iteration `it` at `phase`, then kill the whole job."""
    p = _launch(layout, save, {PAUSE_ENV: f"{phase}:{it}:{marker}"})
    deadline = time.time() + 180
    while not os.path.exists(marker) and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.exists(marker), f"the save never reached {phase} at iteration {it}"
    for pid in [*_children(p.pid), p.pid]:  # the workers, then the agent: a dead node
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return p.communicate(timeout=60)[0]


def _kill_step(layout: str, save: str, rank: int, step: int) -> str:
    p = _launch(layout, save, {"MEGAMOE_FAULT": f"kill_step:{rank}:{step}:0"})
    out = p.communicate(timeout=240)[0]
    assert p.returncode != 0, out[-3000:]  # the agent reports the killed worker
    return out


def _cycle(rng: random.Random, layout: str, save: str, marker: str) -> tuple[str, bool]:
    """One kill; (its log, whether it was mid-save)."""
    done = read_tracker(save) if os.path.exists(save) else 0
    saves_left = list(range(done + SAVE_EVERY, ITERS, SAVE_EVERY))
    if saves_left and rng.random() < 0.5:
        return _mid_save(layout, save, rng.choice(saves_left), rng.choice(PHASES),
                         marker), True
    return _kill_step(layout, save, rng.randrange(2), rng.randint(1, ITERS - done)), False


@pytest.mark.slow
@pytest.mark.timeout(900)  # some 23 torchrun launches of 3 processes each: 300 s was hit
def test_fault_soak(tmp_path):  # on two cores busy with other tests (the suite's default)
    rng, start = random.Random(18), time.time()
    summary = {"cycles": 0, "killed_mid_save": 0, "killed_at_a_step": 0}
    per_layout = [CYCLES // len(LAYOUTS) + (i < CYCLES % len(LAYOUTS))
                  for i in range(len(LAYOUTS))]
    for (layout, _), n in zip(LAYOUTS.items(), per_layout):
        p = _launch(layout, str(tmp_path / f"{layout}_straight"), {})
        straight = {i: (loss, norm) for i, loss, norm in _losses(p.communicate()[0])}
        assert p.returncode == 0 and sorted(straight) == list(range(1, ITERS + 1))
        save, logs = str(tmp_path / layout), []
        for c in range(n):
            if os.path.exists(save) and read_tracker(save) == ITERS:
                break  # finished early (kills came late): the rest of the cycles go on
            log, mid_save = _cycle(rng, layout, save, str(tmp_path / f"m_{layout}_{c}"))
            logs.append(log)
            summary["cycles"] += 1
            summary["killed_mid_save" if mid_save else "killed_at_a_step"] += 1
        p = _launch(layout, save, {})
        logs.append(p.communicate(timeout=240)[0])
        assert p.returncode == 0, logs[-1][-3000:]
        for log in logs:
            for i, loss, norm in _losses(log):
                assert straight[i] == (loss, norm), (layout, i, log[-3000:])
        assert read_tracker(save) == ITERS
    summary["wall_s"] = round(time.time() - start, 1)
    print(json.dumps({"fault_soak": summary}))
    assert summary["cycles"] == CYCLES and summary["killed_mid_save"] >= 5
