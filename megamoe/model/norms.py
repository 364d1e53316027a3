"""LayerNorm / RMSNorm chosen by `config.normalization`.

On a GPU, NVIDIA apex's fused kernels run them when apex is importable (the same math:
statistics in fp32, output in the input's dtype); otherwise, and on the CPU, the portable
path below. The parameters and checkpoints are the same either way.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.config import ModelConfig

try:  # NVIDIA apex (built from NVIDIA's repository; PyPI's "apex" is another package)
    from apex.normalization.fused_layer_norm import (
        fused_layer_norm_affine,
        fused_rms_norm_affine,
    )
except Exception:  # noqa: BLE001 - absent, another package, or built without CUDA
    fused_layer_norm_affine = fused_rms_norm_affine = None


class RMSNorm(nn.Module):
    """x / rms(x) * weight, statistics in fp32 (bf16 mean-of-squares loses too much)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and fused_rms_norm_affine is not None:
            return fused_rms_norm_affine(x, self.weight, self.weight.shape, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm; apex's fused kernel on a GPU when importable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and fused_layer_norm_affine is not None:
            return fused_layer_norm_affine(x, self.weight, self.bias, self.normalized_shape,
                                           self.eps)
        return super().forward(x)


def build_norm(config: ModelConfig, hidden_size: int) -> nn.Module:
    """Norm layer for `config.normalization` (weights one, LayerNorm bias zero)."""
    if config.normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps=config.norm_epsilon)
    if config.normalization == "LayerNorm":
        return LayerNorm(hidden_size, eps=config.norm_epsilon)
    raise ValueError(f"unknown normalization {config.normalization!r} "
                     "(expected LayerNorm or RMSNorm)")
