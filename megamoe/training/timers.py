"""Megatron's timers (--timing-log-level, --log-timers-to-tensorboard).

Level 0 is the iteration time every log line has. Level 1 adds Megatron's level-1 timers
that megamoe's step has: "forward-backward" (the whole pipeline schedule of a step) and
"optimizer" (gradient sync, clipping, the update and the parameter copies). At each log
line the timers of the interval are reduced over all ranks (one all-reduce on the mesh's
device) and printed as Megatron's "(min, max) time across ranks (ms)" block (or, with
--timing-log-option, its "max time" or per-rank "times across ranks" block); with
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

    def per_rank(self, iterations: int, group: Optional[dist.ProcessGroup] = None,
                 distributed: bool = False) -> dict[str, list[float]]:
        """name -> every rank's seconds per iteration since the last call, by rank
        (collective when `distributed`: one all-reduce of a [ranks x timers] table on the
        device, every rank at the same log line)."""
        names = self.names()
        if not names:
            return {}
        k = len(names)
        world = dist.get_world_size(group) if distributed else 1
        rank = dist.get_rank(group) if distributed else 0
        table = torch.zeros(world * k, dtype=torch.float64, device=self.device)
        table[rank * k:(rank + 1) * k] = torch.tensor(
            [self.elapsed.get(n, 0.0) / max(iterations, 1) for n in names], dtype=torch.float64,
            device=self.device)  # (host floats to the device once, at a log line)
        if distributed:
            dist.all_reduce(table, group=group)  # each slot has one writer: the sum is it
        values = table.tolist()  # (at a log line, not on the step's path)
        self.elapsed = {}
        return {n: values[i::k] for i, n in enumerate(names)}


def format_timers(times: dict[str, list[float]], option: str = "minmax") -> str:
    """Megatron's Timers.log block (milliseconds) of Timers.per_rank's table, as
    --timing-log-option asks: the max over ranks, (min, max), or every rank's time."""
    if option == "all":
        lines = ["times across ranks (ms):"]
        for name, per_rank in times.items():
            lines.append(f"  {name}:")
            lines += [f"     rank {r:2d}: {t * 1000:.2f}" for r, t in enumerate(per_rank)]
        return "\n".join(lines)
    lines = ["max time across ranks (ms):" if option == "max" else
             "(min, max) time across ranks (ms):"]
    for name, per_rank in times.items():
        lo, hi = min(per_rank) * 1000, max(per_rank) * 1000
        value = f"{hi:.2f}" if option == "max" else f"({lo:.2f}, {hi:.2f})"
        lines.append(f"    {(name + ' ').ljust(48, '.')}: {value}")
    return "\n".join(lines)


def tensorboard_scalars(times: dict, iteration_seconds: float) -> dict[str, float]:
    """What --log-timers-to-tensorboard writes: the maximum over ranks (Megatron's, whatever
    --timing-log-option prints)."""
    return {"iteration-time": iteration_seconds,
            **{f"{name}-time": max(v) for name, v in times.items()}}
