"""Megatron's timers (--timing-log-level, --log-timers-to-tensorboard).

Level 0 is the iteration time every log line has. Level 1 adds Megatron's level-1 timers
that megamoe's step has: "forward-backward" (the whole pipeline schedule of a step) and
"optimizer" (gradient sync, clipping, the update and the parameter copies). At each log
line the timers of the interval are reduced over all ranks (one all-reduce on the mesh's
device) and printed as Megatron's "(min, max) time across ranks (ms)" block; with
--log-timers-to-tensorboard the per-iteration maximum goes to TensorBoard/W&B as
"{name}-time" (seconds, as Megatron's Timers.write) and the iteration time as
"iteration-time". A running level-1 timer synchronises the device at its start and stop
(as Megatron's timers do) so it measures the device's work, not the kernel launches:
that host sync is only there when the user asks for level 1.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

LEVEL_1 = ("forward-backward", "optimizer")


class Timers:
    """Named wall-clock timers of one rank; `timer(name, level)` times a block when
    --timing-log-level >= level."""

    def __init__(self, level: int, device: torch.device) -> None:
        self.level, self.device = level, torch.device(device)
        self.elapsed: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def timer(self, name: str, level: int) -> Iterator[None]:
        if level > self.level:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.elapsed[name] = self.elapsed.get(name, 0.0) + time.perf_counter() - start

    def names(self) -> list[str]:
        return list(LEVEL_1) if self.level >= 1 else []

    def min_max(self, iterations: int, group: Optional[dist.ProcessGroup] = None,
                distributed: bool = False) -> dict[str, tuple[float, float]]:
        """name -> (min, max) over ranks of the seconds per iteration since the last call
        (collective when `distributed`: every rank calls it at the same log line)."""
        names = self.names()
        if not names:
            return {}
        per_iter = [self.elapsed.get(n, 0.0) / max(iterations, 1) for n in names]
        both = torch.tensor(per_iter + [-v for v in per_iter], dtype=torch.float64,
                            device=self.device)
        if distributed:
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        values = both.tolist()  # (at a log line, not on the step's path)
        self.elapsed = {}
        k = len(names)
        return {n: (-values[k + i], values[i]) for i, n in enumerate(names)}


def format_timers(min_max: dict[str, tuple[float, float]]) -> str:
    """Megatron's Timers.log block (milliseconds)."""
    lines = ["(min, max) time across ranks (ms):"]
    for name, (lo, hi) in min_max.items():
        lines.append(f"    {(name + ' ').ljust(48, '.')}: ({lo * 1000:.2f}, {hi * 1000:.2f})")
    return "\n".join(lines)


def tensorboard_scalars(min_max: dict[str, tuple[float, float]],
                        iteration_seconds: float) -> dict[str, float]:
    """What --log-timers-to-tensorboard writes: the maximum over ranks (Megatron's)."""
    return {"iteration-time": iteration_seconds,
            **{f"{name}-time": hi for name, (_, hi) in min_max.items()}}
