"""LayerNorm / RMSNorm chosen by `config.normalization`.

On a GPU, NVIDIA apex's fused kernels run them when apex is importable (the same math:
statistics in fp32, output in the input's dtype); otherwise, and on the CPU, torch's own
(`F.rms_norm`, fused on CPU and CUDA; `nn.LayerNorm`). The parameters and checkpoints are
the same either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
    """x / rms(x) * weight, statistics in fp32 (bf16 mean-of-squares loses too much).

    torch's fused kernel computes in fp32 and rounds once at the end; Hugging Face's
    Llama/Mixtral norm rounds the normalised input to the model dtype before the weight:
    identical in fp32, one rounding apart in bf16."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and fused_rms_norm_affine is not None:
            return fused_rms_norm_affine(x, self.weight, self.weight.shape, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

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
