"""The language-model loss of a micro-batch, and its share of the step's loss, defined
once for every schedule.

Two normalisations, as Megatron-LM:
- default: the step's loss is the mean over micro-batches of each micro-batch's mean
  per-token loss (with context parallelism, the mean over the whole sequence:
  cp_batch.cp_lm_loss); a micro-batch's share is its mean / num_microbatches.
- `--calculate-per-token-loss`: the step's loss is the sum of the per-token losses over
  every unmasked token of the global batch (all micro-batches, dp and cp ranks) divided
  by their number N, so each token weighs the same whatever micro-batch or document it
  sits in. Megatron back-propagates each micro-batch's loss sum and divides the reduced
  gradients by N at the end of the step. megamoe counts N before the first forward (the
  loss masks of the step's micro-batches, all-reduced over the dp x cp group on the device:
  no host sync) and back-propagates sum x (dp x cp) / N: the data-parallel gradient
  average then gives exactly sum / N, in every layout, with the optimizers unchanged.
  The MTP loss of each depth is likewise its per-token mean over the global batch, N_k
  being the step's tokens whose depth-k target is unmasked (model/mtp.py).
  The MoE auxiliary losses keep their per-micro-batch scale (1 / num_microbatches per dp
  rank): Megatron's stated target for them, which it reaches approximately through token
  counts (exactly when no token is masked).
Either way the shares of a step add up, on each rank, to that rank's part of the step's
loss; their mean over dp x cp (training/loop.py) is the loss that is logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megamoe.parallel.cp_layout import split_for_cp
from megamoe.training.cp_batch import CPInfo, cp_lm_loss
from megamoe.training.spiky_loss import LocalLosses

Batch = dict[str, torch.Tensor]


def masked_lm_loss(loss_BS: torch.Tensor, loss_mask_BS: torch.Tensor) -> torch.Tensor:
    """Mean per-token loss over unmasked tokens (fp32)."""
    mask = loss_mask_BS.to(torch.float32)
    return (loss_BS.float() * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass
class PerTokenLoss:
    """--calculate-per-token-loss: `group` is the group over which dense gradients are
    averaged (dp x cp; None with one rank), `size` its size, `mtp_depths` the model's
    --mtp-num-layers."""

    group: Optional[dist.ProcessGroup]
    size: int
    mtp_depths: int = 0
    scale: Optional[torch.Tensor] = None  # size / N of the current step (device, 0-d)
    num_tokens: Optional[torch.Tensor] = None  # N of the current step (device, 0-d)
    mtp_scales: Optional[torch.Tensor] = None  # [D]: size / N_k (MTP depth k; device)

    def start_step(self, batches: Sequence[Batch], cp: CPInfo) -> None:
        """Count the unmasked tokens N of the step (and N_k of each MTP depth): this rank's
        parts of `batches`, summed over the group, in one all-reduce."""
        rank, cp_size = (cp[1], cp[2]) if cp is not None else (0, 1)
        counts = sum(self._counts(b["loss_mask"].to(torch.float32), rank, cp_size)
                     for b in batches)
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        self.num_tokens = counts[0]
        scales = self.size / counts.clamp(min=1.0)
        self.scale, self.mtp_scales = scales[0], scales[1:]

    def _counts(self, mask_BS: torch.Tensor, rank: int, cp_size: int) -> torch.Tensor:
        """[1 + D]: this rank's unmasked LM tokens, then those of each MTP depth k: the
        targets shifted k + 1 places left, so the sequence's first k + 1 mask entries drop
        out (they sit in chunk 0, cp rank 0's, since a chunk is >= D tokens)."""
        local = split_for_cp(mask_BS, rank, cp_size, dim=1).sum()
        lead = mask_BS[:, :self.mtp_depths].sum(0).cumsum(0) if rank == 0 else \
            torch.zeros(self.mtp_depths, device=mask_BS.device)
        return torch.cat([local[None], local - lead])


def step_share(loss_BS: torch.Tensor, loss_mask_BS: torch.Tensor, cp: CPInfo,
               num_microbatches: int, per_token: Optional[PerTokenLoss]) -> torch.Tensor:
    """This micro-batch's share of the step's LM loss (its backward's loss; the shares of
    a step sum to the rank's part of the step's loss), `loss_BS`/`loss_mask_BS` being this
    rank's tokens (its cp part). With --check-for-spiky-loss the micro-batch's local loss
    is recorded for the check (training/spiky_loss.py)."""
    LocalLosses.record(loss_BS, loss_mask_BS)
    if per_token is not None:
        mask = loss_mask_BS.to(torch.float32)
        return (loss_BS.float() * mask).sum() * per_token.scale
    loss = masked_lm_loss(loss_BS, loss_mask_BS) if cp is None else cp_lm_loss(
        loss_BS, loss_mask_BS, cp)
    return loss / num_microbatches
