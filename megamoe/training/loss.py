"""The language-model loss of a micro-batch, defined once for every schedule."""

from __future__ import annotations

import torch


def masked_lm_loss(loss_BS: torch.Tensor, loss_mask_BS: torch.Tensor) -> torch.Tensor:
    """Mean per-token loss over unmasked tokens (fp32)."""
    mask = loss_mask_BS.to(torch.float32)
    return (loss_BS.float() * mask).sum() / mask.sum().clamp(min=1.0)
