"""When a run stops before --train-iters: --exit-signal-handler, --exit-duration-in-mins and
--exit-interval, as in Megatron-LM, with the decision agreed by every rank.

A cluster preempts a job by sending SIGTERM (to torchrun, which forwards it to its workers
and kills them after a grace period, or to every process of the job step). With
--exit-signal-handler the signal only sets a flag; the current step finishes, and after it
the ranks agree (one all-reduce, MAX over the world) whether any rank has seen the signal
or has run past --exit-duration-in-mins. Agreeing matters: a rank whose clock or signal
came a step later would otherwise run one more step alone and hang in its collectives.
Then the run saves a checkpoint (when --save is set) and ends with exit code 0, skipping
the final evaluation, so the scheduler's resubmission resumes from exactly that step.
--exit-interval needs no agreement: every rank counts the same iterations.

The handler stays installed until the run's last checkpoint is published (the exit save,
the final evaluation, the wait for a background --async-save): a second SIGTERM there is
deferred like the first, never kills the write half-way. A signal that came after the
training loop ends the run with exit code 0 once the checkpoint is published; only when
that checkpoint could not be made does the run end with 128 + the signal, saying so
(UnsavedExit).
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from megamoe.config.train import TrainConfig
from megamoe.parallel.mesh import Mesh


class UnsavedExit(RuntimeError):
    """A signal asked the run to stop and its checkpoint could not be made: the message
    says why; the process exits with 128 + the signal (as a process killed by it)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class ExitConditions:
    """This rank's view of the three early-exit conditions for one run. Use as a context
    manager: the SIGTERM handler is installed on entry and the previous one restored on
    exit (the handler can only be installed from the main thread)."""

    def __init__(self, train: TrainConfig, mesh: Mesh, start_time: float) -> None:
        self.train, self.mesh, self.start_time = train, mesh, start_time
        self.signal_received = False
        self._previous = None

    def __enter__(self) -> ExitConditions:
        if self.train.exit_signal_handler:
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("--exit-signal-handler needs the run in the main thread")
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = True  # acted on after the current step, on every rank

    def unsaved(self, error: Exception) -> UnsavedExit:
        """The exit for a received signal whose checkpoint failed (`error`)."""
        return UnsavedExit(f"received SIGTERM (--exit-signal-handler) and no checkpoint could "
                           f"be saved: {error}", signal.SIGTERM)

    def reason(self, iteration: int) -> Optional[str]:
        """Why the run stops after `iteration` (None: it goes on). The same answer on every
        rank; one all-reduce and one host read per step when the signal handler or the
        duration limit is on, nothing otherwise."""
        t = self.train
        agreed = self._agreed() if (t.exit_signal_handler or t.exit_duration_in_mins) \
            else (False, False)
        if agreed[0]:
            return "received SIGTERM (--exit-signal-handler)"
        if agreed[1]:
            return f"ran past --exit-duration-in-mins {t.exit_duration_in_mins:g}"
        if t.exit_interval and iteration % t.exit_interval == 0:
            return f"--exit-interval {t.exit_interval}"
        return None

    def _agreed(self) -> tuple[bool, bool]:
        minutes = (time.time() - self.start_time) / 60.0
        limit = self.train.exit_duration_in_mins
        local = torch.tensor([float(self.signal_received),
                              float(bool(limit) and minutes > limit)],
                             device=self.mesh.device)
        if self.mesh.world_size > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        sig, late = local.tolist()
        return sig > 0, late > 0
