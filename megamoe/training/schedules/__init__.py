"""Schedules: the micro-batches of one global batch without pipelining (local.py) or
through the pipeline (pipeline.py: 1F1B and interleaved), and the learning rate over the
iterations (lr.py)."""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from megamoe.model.pipeline_stage import PipelineModel
from megamoe.training.loss import PerTokenLoss
from megamoe.training.schedules.local import Batch, GradSync, forward_backward_no_pipelining
from megamoe.training.schedules.lr import LRScheduler
from megamoe.training.schedules.pipeline import forward_backward_pipelining


def forward_backward(model: torch.nn.Module, data_iter: Iterator[Batch],
                     num_microbatches: int, *, forward_only: bool = False,
                     grad_sync: Optional[GradSync] = None,
                     per_token: Optional[PerTokenLoss] = None,
                     loss_scale: float = 1.0) -> torch.Tensor:
    """The schedule for `model`: pipelined (1F1B / interleaved) for a PipelineModel.
    `grad_sync`: the optimizer's overlapped gradient buckets (--overlap-grad-reduce);
    `per_token`: --calculate-per-token-loss (training/loss.py); `loss_scale`: the
    optimizer's (--fp16), multiplying the backward (the returned loss is unscaled)."""
    run = (forward_backward_pipelining if isinstance(model, PipelineModel)
           else forward_backward_no_pipelining)
    return run(model, data_iter, num_microbatches, forward_only=forward_only,
               grad_sync=grad_sync, per_token=per_token, loss_scale=loss_scale)


__all__ = ["Batch", "GradSync", "LRScheduler", "forward_backward", "forward_backward_no_pipelining",
           "forward_backward_pipelining"]
