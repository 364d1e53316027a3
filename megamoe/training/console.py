"""The operator's console: what a person watching a run needs beyond Megatron's line.

Megatron's iteration line says how fast a step is but not when the run ends, how close
the device is to its memory limit, or how well the hardware is used; and it prints
nothing until the first --log-interval, so a run that is slow to start (or already
diverging) looks hung. The console adds, after Megatron's own fields (a parser that
reads Megatron's line by field name or position keeps working):

* ``ETA``: the remaining iterations times the mean step time of this run, the first step
  left out once a later one exists (it pays for allocation, and compilation with
  --compile, which later steps do not repeat);
* peak memory: ``torch.cuda.max_memory_allocated`` on a GPU; on a CPU the host process's
  peak resident set size, labelled as such (it includes Python and the data loader, not
  only tensors, so it is not the same quantity);
* ``TFLOP/s/GPU`` (model FLOPs, megamoe/model/flops.py) when --log-throughput has not
  already put Megatron's ``throughput per GPU`` field in the line, and ``MFU`` where the
  device's peak is known (--peak-tflops or the GPU table in metrics.py).

`StepClock` also decides which iterations get an early line (--log-first-iterations).
Reading the allocator's peak is a host-side counter, not a device sync.
"""

from __future__ import annotations

import resource
import time
from typing import Optional

import torch


def format_eta(seconds: float) -> str:
    """h:mm:ss, with days in front past 24 h ("2 days, 3:04:05"), as timedelta prints."""
    seconds = max(0, int(round(seconds)))
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    clock = f"{h}:{m:02d}:{s:02d}"
    return clock if not days else f"{days} day{'s' if days > 1 else ''}, {clock}"


class StepClock:
    """Wall time of this run's steps, for the ETA: started at the loop's first step."""

    def __init__(self, now: Optional[float] = None) -> None:
        self.start = time.time() if now is None else now
        self.first_done: Optional[float] = None
        self.steps = 0

    def step_done(self, now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        self.steps += 1
        if self.first_done is None:
            self.first_done = now

    def mean_step_s(self, now: Optional[float] = None) -> Optional[float]:
        """Seconds per step: since the first step ended over the steps after it, or the
        first step's own time while it is the only one (None before any step)."""
        if self.first_done is None:
            return None
        now = time.time() if now is None else now
        if self.steps == 1:
            return self.first_done - self.start
        return (now - self.first_done) / (self.steps - 1)

    def eta_s(self, remaining_iters: int, now: Optional[float] = None) -> Optional[float]:
        mean = self.mean_step_s(now)
        return None if mean is None else mean * max(0, remaining_iters)


def peak_memory(device: torch.device) -> tuple[str, float]:
    """(label, GiB) of this process's peak memory: CUDA's allocator peak on a GPU, the
    host peak RSS elsewhere (Linux reports ru_maxrss in KiB)."""
    if device.type == "cuda":
        return "peak memory allocated (GiB)", torch.cuda.max_memory_allocated(device) / 2**30
    return ("peak host RSS (GiB)",
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


def console_fields(*, eta_s: Optional[float], memory: tuple[str, float],
                   tflops_per_gpu: Optional[float], mfu: Optional[float]) -> list[str]:
    """The fields appended to Megatron's line, in this order: ETA, peak memory, TFLOP/s
    per GPU (None: Megatron's own field already carries it), MFU (None: no known peak)."""
    fields = [f"ETA: {format_eta(eta_s) if eta_s is not None else 'n/a'}",
              f"{memory[0]}: {memory[1]:.2f}"]
    if tflops_per_gpu is not None:
        fields.append(f"TFLOP/s/GPU: {tflops_per_gpu:.3g}")
    if mfu is not None:
        fields.append(f"MFU: {100.0 * mfu:.3g}%")
    return fields


def log_early(steps_done: int, iteration: int, first_iterations: int,
              log_interval: int) -> bool:
    """Whether the step just done (`steps_done`-th of this run, global `iteration`) gets a
    line of its own: the first --log-first-iterations steps of every run, a resumed one
    included, unless the --log-interval line is due anyway."""
    return steps_done <= first_iterations and iteration % log_interval != 0
