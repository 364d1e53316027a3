"""Megatron's --manual-gc: Python's automatic (threshold-triggered) garbage collector is
turned off for the run and collections happen at chosen points instead, the same on every
rank, so one rank's collection never stalls the collectives the others wait in.

Megatron's points: a full collection when training starts; with --manual-gc-interval N a
full collection after every iteration divisible by N (0: none during training); unless
--no-manual-gc-eval, a full collection before each evaluation and a generation-0 one after
it (the objects evaluation made). Megatron's process exits after training; megamoe also
restores the collector's earlier state when training returns (library and test use).
"""

from __future__ import annotations

import gc
from typing import Callable, Optional

from megamoe.config import TrainConfig


class ManualGC:
    """The collection points of one training run (does nothing without --manual-gc)."""

    def __init__(self, config: TrainConfig,
                 collect: Optional[Callable[..., int]] = None) -> None:
        self.on, self.interval = config.manual_gc, config.manual_gc_interval
        self.eval = config.manual_gc_eval
        self.collect = collect or gc.collect
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> ManualGC:
        if self.on:
            gc.disable()
            self.collect()
        return self

    def __exit__(self, *exc) -> None:
        if self.on and self._was_enabled:
            gc.enable()

    def after_step(self, iteration: int) -> None:
        if self.on and self.interval and iteration % self.interval == 0:
            self.collect()

    def before_eval(self) -> None:
        if self.on and self.eval:
            self.collect()

    def after_eval(self) -> None:
        if self.on and self.eval:
            self.collect(generation=0)
