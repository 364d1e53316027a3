"""LayerNorm / RMSNorm chosen by `config.normalization`."""

from __future__ import annotations

import torch
from torch import nn

from megamoe.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, statistics in fp32 (bf16 mean-of-squares loses too much)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(config: ModelConfig, hidden_size: int) -> nn.Module:
    """Norm layer for `config.normalization` (weights one, LayerNorm bias zero)."""
    if config.normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps=config.norm_epsilon)
    if config.normalization == "LayerNorm":
        return nn.LayerNorm(hidden_size, eps=config.norm_epsilon)
    raise ValueError(f"unknown normalization {config.normalization!r} "
                     "(expected LayerNorm or RMSNorm)")
