"""--check-for-spiky-loss (Megatron-LM's), as Megatron's rerun state machine runs it in
its `disabled` mode (the mode megamoe runs: cli/runhealth_args.py).

Megatron's rule (pretrain_gpt.py loss_func -> RerunStateMachine.is_unexpectedly_large,
threshold SPIKY_LOSS_FACTOR = 10, context "loss", num_samples 100): each rank validates
the local loss of every micro-batch it computes (the sum of its unmasked tokens' losses,
before any reduction; only the last pipeline stage has one). The first 100 values set the
reference, their largest magnitude (not a sliding window: it stays fixed afterwards); a
later value >= 10x that maximum is spiky. NaN/Inf are never spiky (the NaN check's
business). A spiky loss is not fatal: the rank logs Megatron's warning line

    Rank R, node N, device D, iteration I: Unexpected result V (message='Spiky loss')

and training goes on. Megatron also counts evaluation micro-batches (its loss_func runs
there with the state machine disabled); here only training micro-batches count, so an
evaluation set's losses never move the training reference (docs/run-health.md).

Cost: off, nothing. On, each micro-batch's local sum is kept on the device and the step's
values are read in one host sync after the forward-backward (Megatron reads each
micro-batch's loss with .item()).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Iterator, Optional

import torch

SPIKY_LOSS_FACTOR = 10.0  # Megatron's pretrain_gpt.py
NUM_SAMPLES = 100  # Megatron's is_unexpectedly_large default
MESSAGE = "Spiky loss"

logger = logging.getLogger(__name__)


class LocalLosses:
    """The local loss of each training micro-batch of the step running now (the schedules
    report them through `record` while `recording` is active; otherwise nothing is kept)."""

    _values: Optional[list[torch.Tensor]] = None

    @classmethod
    @contextlib.contextmanager
    def recording(cls, active: bool) -> Iterator[list[torch.Tensor]]:
        """Keep the losses while the block runs (`active`: --check-for-spiky-loss; off,
        the schedules' `record` does nothing, not even the sum)."""
        cls._values = [] if active else None
        try:
            yield cls._values if active else []
        finally:
            cls._values = None

    @classmethod
    def record(cls, loss_BS: torch.Tensor, loss_mask_BS: torch.Tensor) -> None:
        """Megatron's loss_func value: sum(losses * mask) of this rank's tokens."""
        if cls._values is not None:
            cls._values.append((loss_BS.detach().float() * loss_mask_BS.float()).sum())


class SpikyLossCheck:
    """One rank's reference (the largest |loss| of its first NUM_SAMPLES micro-batches)
    and the verdict on each later one."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.count, self.max_value = 0, 0.0

    def is_spiky(self, value: float) -> bool:
        """Megatron's is_unexpectedly_large(threshold=10, num_samples=100)."""
        value = math.fabs(value)
        if math.isnan(value) or math.isinf(value):
            return False
        if self.count < NUM_SAMPLES:
            self.count += 1
            self.max_value = max(self.max_value, value)
            if self.count == NUM_SAMPLES:
                logger.warning(f"Max value for loss: {self.max_value}")
            return False
        return value >= self.max_value * SPIKY_LOSS_FACTOR

    def see_step(self, losses: list[float], iteration: int) -> list[float]:
        """The step's micro-batch losses (host values: read with the optimizer's verdict,
        nonfinite.Riders, not on their own); warns for each spiky one and returns those
        values."""
        spiky = [v for v in losses if self.is_spiky(v)]
        for v in spiky:
            logger.warning(f"Rank {self.rank}, node {os.uname()[1]}, device {self.device}, "
                           f"iteration {iteration}: Unexpected result {v} "
                           f"(message='{MESSAGE}')")
        return spiky
