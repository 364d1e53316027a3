"""FP8 quantisation formulas, as Transformer Engine's (cited per function).

A tensor x is stored as q = saturate(x * scale) in an FP8 dtype, with scale_inv = 1/scale
kept beside it: x ~= q * scale_inv. The scale maps the tensor's largest magnitude (amax)
onto the format's largest finite value (E4M3: 448, E5M2: 57344), less 2^margin of headroom.
Values past the format's range saturate to +-max (TE casts with saturation): an FP8 cast
in torch without the clamp would give NaN (E4M3) or inf (E5M2).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_FP32_MAX = torch.finfo(torch.float32).max


def format_dtypes(fp8_format: str) -> tuple[torch.dtype, torch.dtype]:
    """(forward dtype for inputs and weights, backward dtype for output gradients):
    TE's recipe.Format: E4M3 = (E4M3, E4M3); HYBRID = (E4M3, E5M2)."""
    if fp8_format == "e4m3":
        return E4M3, E4M3
    if fp8_format == "hybrid":
        return E4M3, E5M2
    raise ValueError(f"unknown FP8 format {fp8_format!r}")


def delayed_scale(amax: torch.Tensor, prev_scale: torch.Tensor, fp8_max: float,
                  margin: int) -> torch.Tensor:
    """TE's `_default_sf_compute` (transformer_engine/pytorch/quantization.py, DelayedScaling):
    scale = (fp8_max / amax) / 2^margin; amax == 0, inf or NaN keeps the previous scale;
    an infinite scale (amax below fp32's range) becomes fp32's max."""
    sf = (fp8_max / amax) / (2.0 ** margin)
    sf = torch.where(amax > 0.0, sf, prev_scale)
    sf = torch.where(torch.isfinite(amax), sf, prev_scale)
    return torch.where(torch.isinf(sf), torch.full_like(sf, _FP32_MAX), sf)


def current_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """TE's `compute_scale_from_amax` (common/recipe/recipe_common.cuh, Float8CurrentScaling,
    no power-of-2 rounding, epsilon 0): scale = fp8_max / amax; amax == 0 or non-finite
    gives 1; an infinite scale gives fp32's max."""
    sf = fp8_max / amax
    sf = torch.where((amax > 0.0) & torch.isfinite(amax), sf, torch.ones_like(sf))
    return torch.where(torch.isinf(sf), torch.full_like(sf, _FP32_MAX), sf)


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 scalar on x's device (no host sync)."""
    return x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate(x * scale) cast to `dtype` (E4M3 or E5M2); scale is broadcast (a scalar,
    or one per row). NaN stays NaN."""
    fp8_max = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale_inv in fp32 (the value an FP8 GEMM reads)."""
    return q.float() / scale
