"""Forward/backward over the micro-batches of one global batch (no pipelining).

Loss normalisation, in one place: each micro-batch's LM loss is the mean over its
unmasked tokens; the step's loss is the mean over micro-batches. So each backward is
scaled by 1 / num_microbatches, and the MoE auxiliary losses, which the MoE layers attach
to the graph, are scaled the same way through `set_aux_loss_backward_scale`. Data-parallel
averaging of gradients then yields the mean over the global batch in any layout.
"""

from __future__ import annotations

from typing import Iterator, Optional, Protocol

import torch

from megamoe.moe.global_batch import start_global_batch
from megamoe.moe.losses import set_aux_loss_backward_scale
from megamoe.training.cp_batch import context_parallel_of, cp_lm_loss, split_batch
from megamoe.training.loss import masked_lm_loss

Batch = dict[str, torch.Tensor]


class GradSync(Protocol):
    """What a schedule tells the data-parallel gradient buckets (--overlap-grad-reduce,
    training/optim/overlap.py): whether the backward about to run is the last one of the
    step for the parameters it reaches (Megatron's no_sync() around all the others)."""

    last_microbatch: bool


def forward_step(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    cp = context_parallel_of(model)
    batch = split_batch(batch, cp)  # this cp rank's chunks (the batch itself without CP)
    extra = {}
    if getattr(model, "mtp", None) is not None:  # MTP masks its loss with the batch's mask
        extra["loss_mask"] = batch["loss_mask"]
    loss_BS = model(batch["tokens"], position_ids=batch.get("position_ids"),
                    labels=batch["labels"], document_ids=batch.get("document_ids"), **extra)
    if cp is not None:
        return cp_lm_loss(loss_BS, batch["loss_mask"], cp)
    return masked_lm_loss(loss_BS, batch["loss_mask"])


def forward_backward_no_pipelining(model: torch.nn.Module, data_iter: Iterator[Batch],
                                   num_microbatches: int, *, forward_only: bool = False,
                                   grad_sync: Optional[GradSync] = None) -> torch.Tensor:
    """Run `num_microbatches` micro-batches; returns the mean LM loss (detached, fp32).
    `grad_sync` learns which backward is the step's last (its buckets launch then)."""
    total = torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    set_aux_loss_backward_scale(1.0 / num_microbatches)
    if not forward_only:
        start_global_batch(model)  # global_aux_loss counts restart with each global batch
    for i in range(num_microbatches):
        batch = next(data_iter)
        if forward_only:
            with torch.no_grad():
                loss = forward_step(model, batch)
        else:
            loss = forward_step(model, batch)
            if grad_sync is not None:
                grad_sync.last_microbatch = i == num_microbatches - 1
            (loss / num_microbatches).backward()
        total += loss.detach()
    if grad_sync is not None:
        grad_sync.last_microbatch = False
    return total / num_microbatches
