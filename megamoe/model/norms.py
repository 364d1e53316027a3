"""LayerNorm / RMSNorm chosen by `config.normalization`.

On a GPU, NVIDIA apex's fused kernels run them when apex's CUDA extension loads
(apex_kernels.py; the same math: statistics in fp32, output in the input's dtype);
otherwise, and on the CPU, torch's own
(`F.rms_norm`, fused on CPU and CUDA; `nn.LayerNorm`). The parameters and checkpoints are
the same either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.apex_kernels import apex_kernels
from megamoe.parallel.comm import all_reduce_sum


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
        fused = apex_kernels().fused_rms_norm_affine if x.is_cuda else None
        if fused is not None:
            return fused(x, self.weight, self.weight.shape, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole q or k projection (all heads' channels, one weight per
    channel): OLMoE's q/k norm, `--qk-layernorm-scope projection`.

    Under tensor parallelism a rank holds a contiguous slice of the heads (the q or k block
    of linear_qkv split over TP), so `shard(tp)` keeps the same slice of the weight and the
    forward sums the squares over the TP group (differentiably: `all_reduce_sum`) before
    dividing by the full width: the statistic of the single-process norm. Statistics in
    fp32; the normalised input is rounded to its dtype before the weight, as OLMoE's norm.
    """

    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__(size, eps)
        self.full_size = size
        self.group = None  # TP group (parallelize's shard sets it)

    @torch.no_grad()
    def shard(self, tp) -> None:
        """Keep TP rank `tp.rank`'s chunk of the channels (its heads'); `tp`: a
        parallel.tensor_parallel.TensorParallel."""
        if self.weight.shape[0] != self.full_size:
            raise ValueError("ProjectionRMSNorm is already sharded")
        if tp.size > 1:
            if self.full_size % tp.size:
                raise ValueError(f"q/k norm width {self.full_size} is not divisible by the "
                                 f"tensor-parallel size {tp.size}")
            self.weight = nn.Parameter(self.weight.chunk(tp.size)[tp.rank].clone())
            self.group = tp.group
        self.weight.tensor_model_parallel = tp.size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 or wider
        sumsq = all_reduce_sum(x32.pow(2).sum(-1, keepdim=True), self.group)
        normed = x32 * torch.rsqrt(sumsq / self.full_size + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]} of {self.full_size}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm; apex's fused kernel on a GPU when its extension loads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = apex_kernels().fused_layer_norm_affine if x.is_cuda else None
        if fused is not None:
            return fused(x, self.weight, self.bias, self.normalized_shape, self.eps)
        return super().forward(x)


def build_norm(config: ModelConfig, hidden_size: int) -> nn.Module:
    """Norm layer for `config.normalization` (weights one, LayerNorm bias zero)."""
    if config.normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps=config.norm_epsilon)
    if config.normalization == "LayerNorm":
        return LayerNorm(hidden_size, eps=config.norm_epsilon)
    raise ValueError(f"unknown normalization {config.normalization!r} "
                     "(expected LayerNorm or RMSNorm)")
