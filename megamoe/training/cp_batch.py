"""Context parallelism on the training side: each cp rank's part of a batch, and the LM
loss of a sequence split over the cp group (Megatron's get_batch_on_this_cp_rank and
loss_func).

Every cp rank of one data-parallel replica reads the same batch (the data loader follows
the dp rank); `split_batch` keeps this rank's chunks r and 2CP-1-r of every [B, S] tensor
(parallel/cp_layout.py's load-balanced layout). Positions are made explicit first
(arange when the batch has none), so RoPE and learned position embeddings see each token's
place in the whole sequence; document ids split like the tokens.

The loss: this rank's masked loss sum and token count, the pair all-reduced over cp on
the device (no host sync). The value is the mean over the whole sequence on every cp rank;
the gradient is that of local_sum x CP / total_count, as Megatron's loss x cp_size: the
data-parallel gradient average runs over dp x cp, so summing these over cp gives exactly
the gradient of the whole sequence's mean.
"""

from __future__ import annotations

from typing import Optional

import torch

from megamoe.parallel.context_parallel import cp_masked_mean
from megamoe.parallel.cp_layout import split_for_cp

Batch = dict[str, torch.Tensor]
CPInfo = Optional[tuple]  # (group, rank, size) from parallelize's apply_context_parallel


def context_parallel_of(model: torch.nn.Module) -> CPInfo:
    return getattr(model, "context_parallel", None)


def split_batch(batch: Batch, cp: CPInfo) -> Batch:
    """This cp rank's part of every [B, S] tensor of `batch` (the batch itself without CP)."""
    if cp is None:
        return batch
    _, rank, size = cp
    out = dict(batch)
    if "position_ids" not in out:
        tokens = out["tokens"]
        out["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device
                                           ).expand_as(tokens)
    return {k: split_for_cp(v, rank, size, dim=1) for k, v in out.items()}


def cp_lm_loss(loss_BS: torch.Tensor, loss_mask_BS: torch.Tensor, cp: CPInfo) -> torch.Tensor:
    """Mean per-token loss over the unmasked tokens of the whole (cp-split) sequence."""
    group, _, size = cp
    return cp_masked_mean(loss_BS, loss_mask_BS, group, size)
