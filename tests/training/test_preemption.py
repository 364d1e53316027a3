"""Preemption: --exit-signal-handler (SIGTERM), --exit-duration-in-mins and --exit-interval
stop every rank after the same step, save, exit 0, and the resumed run continues bitwise.

The signal is delivered as a cluster delivers it: to a single-process run, to the torchrun
agent (which forwards SIGTERM to its workers and kills them after a 30-second grace
period), and to one worker only (the ranks must still agree on the step to stop after).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

from megamoe.training.checkpoint import PAUSE_ENV, TRACKER, read_tracker
from megamoe.training.checkpoint.publish import PAUSE_SECONDS_ENV
from megamoe.training.run_record import RUN_RECORDS
from tests.training.test_crash_resume import _run
from tests.training.test_pretrain import ROOT, TINY_MOE

LONG = "--train-iters 2000"  # the schedule of a long run
EXITED = re.compile(r"exiting after iteration (\d+): (.*)")


def _start(argv: list[str], extra: str, env: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(torch.get_num_threads()),
               **(env or {}))
    return subprocess.Popen([*argv, *shlex.split(f"{TINY_MOE} {extra}")], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_line(p: subprocess.Popen, needle: str, timeout: float = 120.0) -> list[str]:
    """Read p's output until a line contains `needle`; returns the lines read."""
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            break
        lines.append(line)
        if needle in line:
            return lines
    p.kill()
    raise AssertionError(f"never saw {needle!r}: {''.join(lines)[-3000:]}")


def _finish(p: subprocess.Popen, lines: list[str], timeout: float = 120.0) -> tuple[int, str]:
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, "".join(lines) + out


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return sorted(out)


def _exited_at(log: str) -> tuple[int, str]:
    found = EXITED.findall(log)
    assert found, log[-3000:]
    return int(found[-1][0]), found[-1][1]


def test_sigterm_saves_and_exits_0_and_the_resumed_run_is_bitwise(tmp_path):
    save = tmp_path / "ck"
    p = _start([sys.executable, "pretrain_gpt.py"],
               f"{LONG} --exit-signal-handler --save {save} --save-interval 1000")
    lines = _wait_for_line(p, "iteration        3/")
    p.send_signal(signal.SIGTERM)
    rc, log = _finish(p, lines)
    assert rc == 0, log[-3000:]
    stop, why = _exited_at(log)
    assert "SIGTERM" in why and stop >= 3
    assert read_tracker(str(save)) == stop
    assert "validation loss" not in log  # as Megatron: no final evaluation on an exit
    # The resumed run (same schedule) continues exactly where the straight run would be.
    end = f"--exit-interval {stop + 2}"
    straight = _run(f"{LONG} {end}")
    resumed = _run(f"{LONG} {end} --load {save}")
    assert [h["iteration"] for h in resumed] == [stop + 1, stop + 2]
    assert resumed == straight[stop:]


def test_exit_interval_saves_and_skips_the_final_evaluation(tmp_path):
    save = tmp_path / "ck"
    hist = _run(f"{LONG} --exit-interval 3 --save {save} --eval-iters 1")
    assert [h["iteration"] for h in hist] == [1, 2, 3]
    assert read_tracker(str(save)) == 3


def _wait_for_file(p: subprocess.Popen, path: str, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if p.poll() is not None or time.time() > deadline:
            p.kill()
            raise AssertionError(f"the save never reached the pause ({path}): rc {p.poll()}")
        time.sleep(0.05)


@pytest.mark.parametrize("mode,phase", [
    ("--async-save", "after_write"),  # the wait for the background write, after the loop
    pytest.param("", "before_write", marks=pytest.mark.slow)])  # the blocking exit save
def test_second_sigterm_during_the_exit_save_is_deferred(tmp_path, mode, phase):
    """A second SIGTERM while the exit checkpoint is written (the background write being
    published, or the blocking save) is deferred like the first: the checkpoint is
    published, the run exits 0 and leaves no temporary directory."""
    save, marker = tmp_path / "ck", str(tmp_path / "paused")
    p = _start([sys.executable, "pretrain_gpt.py"],
               f"{LONG} --exit-signal-handler --save {save} --save-interval 1000 {mode}",
               env={PAUSE_ENV: f"{phase}:*:{marker}", PAUSE_SECONDS_ENV: "1"})
    lines = _wait_for_line(p, "iteration        3/")
    p.send_signal(signal.SIGTERM)
    _wait_for_file(p, marker)  # the exit save is under way
    p.send_signal(signal.SIGTERM)
    rc, log = _finish(p, lines)
    assert rc == 0, log[-3000:]
    stop, why = _exited_at(log)
    assert "SIGTERM" in why and read_tracker(str(save)) == stop
    assert sorted(set(os.listdir(save)) - RUN_RECORDS) == \
        sorted([TRACKER, f"iter_{stop:07d}"])


def _torchrun(extra: str) -> subprocess.Popen:
    return _start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2", "pretrain_gpt.py"], extra)


def test_sigterm_to_one_worker_stops_every_rank_after_the_same_step(tmp_path):
    """SIGTERM reaches rank 0 only: both ranks stop after the same iteration (the last
    rank logs it), save it and exit 0; torchrun then exits 0."""
    save = tmp_path / "ck"
    p = _torchrun(f"{LONG} --exit-signal-handler --save {save} --save-interval 1000")
    lines = _wait_for_line(p, "iteration        3/")
    workers = _children(p.pid)
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGTERM)  # rank 0 (started first)
    rc, log = _finish(p, lines)
    assert rc == 0, log[-3000:]
    stop, why = _exited_at(log)
    assert "SIGTERM" in why
    assert read_tracker(str(save)) == stop
    assert f"iteration {stop + 1:8d}/" not in log  # no rank ran a step past it


@pytest.mark.slow
def test_sigterm_to_the_torchrun_agent(tmp_path):
    """The agent forwards SIGTERM to every worker; they save within its grace period."""
    save = tmp_path / "ck"
    p = _torchrun(f"{LONG} --exit-signal-handler --save {save} --save-interval 1000")
    lines = _wait_for_line(p, "iteration        3/")
    p.send_signal(signal.SIGTERM)
    _rc, log = _finish(p, lines)  # the agent itself reports the signal (non-zero)
    stop, why = _exited_at(log)
    assert "SIGTERM" in why and read_tracker(str(save)) == stop
    resumed = _torchrun(f"{LONG} --exit-interval {stop + 1} --load {save} --save {save}")
    rc, log2 = _finish(resumed, [])
    assert rc == 0 and f"loaded checkpoint from {save} at iteration {stop}" in log2
    assert read_tracker(str(save)) == stop + 1


@pytest.mark.slow
def test_exit_duration_is_agreed_across_ranks(tmp_path):
    """Rank 1's clock says the run started an hour ago: it is past --exit-duration-in-mins
    after step 1, rank 0 is not. The ranks agree, so both stop after step 1 and save it
    (deciding alone, rank 1 would leave rank 0 waiting in step 2's collectives)."""
    save = tmp_path / "ck"
    worker = os.path.join(ROOT, "tests", "training", "fault_worker.py")
    p = _start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", worker],
               f"{LONG} --exit-duration-in-mins 30 --save {save} "
               "--distributed-timeout-minutes 0.2",
               env={"MEGAMOE_FAULT": "late_clock:1:0:3600"})
    rc, log = _finish(p, [])
    assert rc == 0, log[-3000:]
    assert _exited_at(log) == (1, "ran past --exit-duration-in-mins 30")
    assert read_tracker(str(save)) == 1


def test_sigterm_whose_checkpoint_fails_exits_128_plus_the_signal(tmp_path, monkeypatch,
                                                                   capsys):
    """Preempted, and the exit checkpoint cannot be written: one line that says so and
    exit code 143 (128 + SIGTERM), never 0 as if the run could be resumed from it."""
    from megamoe.cli.main import main
    from megamoe.training.checkpoint import CheckpointError
    from megamoe.training.checkpoint.manager import CheckpointManager

    def failing_save(self, iteration, consumed):
        os.kill(os.getpid(), signal.SIGTERM)  # the preemption arrives during the save
        raise CheckpointError(f"saving checkpoint iteration {iteration} failed: disk full")

    monkeypatch.setattr(CheckpointManager, "save", failing_save)
    code = main(shlex.split(f"{TINY_MOE} --train-iters 3 --exit-signal-handler "
                            f"--save {tmp_path / 'ck'} --save-interval 2"))
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("megamoe.data: ")]  # (the data layer's progress lines)
    assert code == 128 + signal.SIGTERM, err
    assert len(err) == 1 and "received SIGTERM" in err[0] and "no checkpoint" in err[0]
    assert "iteration 2 failed: disk full" in err[0]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was restored
