"""Forward/backward over the micro-batches of one global batch (no pipelining).

Loss normalisation, in one place (training/loss.py): each micro-batch backpropagates
its share of the step's loss (by default its mean over unmasked tokens / num_microbatches;
with --calculate-per-token-loss its sum x dp x cp / the step's token count), and the MoE
auxiliary losses, which the MoE layers attach to the graph, are scaled by
1 / num_microbatches through `set_aux_loss_backward_scale`. Data-parallel averaging of
gradients then yields the global batch's loss gradient in any layout. Under loss scaling
(--fp16) each share is multiplied by the loss scale before its backward, and the aux-loss
gradients with it (Megatron's grad_scale_func); the optimizer unscales.
"""

from __future__ import annotations

from typing import Iterator, Optional, Protocol

import torch

from megamoe.moe.global_batch import start_global_batch
from megamoe.moe.losses import set_aux_loss_backward_scale
from megamoe.training.cp_batch import context_parallel_of, split_batch
from megamoe.training.loss import PerTokenLoss, step_share

Batch = dict[str, torch.Tensor]


class GradSync(Protocol):
    """What a schedule tells the data-parallel gradient buckets (--overlap-grad-reduce,
    training/optim/overlap.py): whether the backward about to run is the last one of the
    step for the parameters it reaches (Megatron's no_sync() around all the others)."""

    last_microbatch: bool


def forward_step(model: torch.nn.Module, batch: Batch, num_microbatches: int = 1,
                 per_token: Optional[PerTokenLoss] = None) -> torch.Tensor:
    """The micro-batch's share of the step's LM loss (training/loss.py)."""
    cp = context_parallel_of(model)
    batch = split_batch(batch, cp)  # this cp rank's chunks (the batch itself without CP)
    extra = {}
    if getattr(model, "mtp", None) is not None:  # MTP masks its loss with the batch's mask
        extra["loss_mask"] = batch["loss_mask"]
        if per_token is not None:
            extra["mtp_token_scales"] = per_token.mtp_scales
    loss_BS = model(batch["tokens"], position_ids=batch.get("position_ids"),
                    labels=batch["labels"], document_ids=batch.get("document_ids"), **extra)
    return step_share(loss_BS, batch["loss_mask"], cp, num_microbatches, per_token)


def forward_backward_no_pipelining(model: torch.nn.Module, data_iter: Iterator[Batch],
                                   num_microbatches: int, *, forward_only: bool = False,
                                   grad_sync: Optional[GradSync] = None,
                                   per_token: Optional[PerTokenLoss] = None,
                                   loss_scale: float = 1.0) -> torch.Tensor:
    """Run `num_microbatches` micro-batches; returns this rank's part of the step's LM
    loss (detached, fp32, unscaled). `grad_sync` learns which backward is the step's last
    (its buckets launch then); `per_token`: --calculate-per-token-loss (the step's
    micro-batches are read before the first forward, to count their tokens);
    `loss_scale`: the optimizer's (--fp16), multiplying every backward."""
    total = torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    set_aux_loss_backward_scale(1.0 / num_microbatches, loss_scale)
    if not forward_only:
        start_global_batch(model)  # global_aux_loss counts restart with each global batch
    batches: Iterator[Batch] = data_iter
    if per_token is not None:
        read = [next(data_iter) for _ in range(num_microbatches)]
        per_token.start_step(read, context_parallel_of(model))
        batches = iter(read)
    for i in range(num_microbatches):
        batch = next(batches)
        with torch.set_grad_enabled(not forward_only):
            loss = forward_step(model, batch, num_microbatches, per_token)
        if not forward_only:
            if grad_sync is not None:
                grad_sync.last_microbatch = i == num_microbatches - 1
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        total += loss.detach()
    if grad_sync is not None:
        grad_sync.last_microbatch = False
    return total
