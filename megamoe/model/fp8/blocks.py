"""Block-scaled FP8 quantisation: one scale per tile of a tensor, for the recipes whose
scales are finer than a whole tensor (cited per function).

  blockwise  Transformer Engine's Float8BlockScaling (DeepSeek-V3's recipe): inputs and
             output gradients in 1x128 tiles, weights in 128x128 blocks; fp32 scales
             rounded down to a power of 2 (TE's default `power_2_scale=True`, amax epsilon 0:
             transformer_engine/common/recipe/__init__.py at 000b637e).
  mxfp8      TE's MXFP8BlockScaling (OCP MX): 1x32 tiles for every operand, E8M0 scales
             (a power of 2 stored as a biased exponent).
  rowwise    megamoe's extension (torchao's row-wise recipe): one scale per row of each
             GEMM operand along the contraction dimension, rounded down to a power of 2.

Every tile runs along the GEMM's contraction dimension K (the last dimension of an operand
laid out [rows, K]); a GEMM operand and its transpose are therefore quantised separately
from the high-precision tensor (as TE: "the quantized tensor and its transpose are not
numerically equivalent"), except 128x128 weight blocks, whose transpose is exact.

A dimension that is not a multiple of the tile is handled as TE's scale tensors do: the
last tile is partial, which is the same as zero-padding the tensor to whole tiles (zeros
change no amax and quantise to zero). x ~= q * scale_inv, the scale_inv of q's tile.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megamoe.model.fp8.quantize import FP8_MAX

BLOCK_RECIPES = ("blockwise", "mxfp8", "rowwise")
_FP32_MAX = torch.finfo(torch.float32).max


def pow2_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """TE's compute_scale_from_amax with force_pow_2_scales, epsilon 0
    (transformer_engine/common/recipe/recipe_common.cuh at 01c24fe0): scale = fp8_max /
    amax; amax 0, inf or NaN gives 1; an infinite quotient gives fp32's max; then the
    mantissa bits are cleared (`scale_bits &= 0xFF800000`), i.e. the scale is rounded
    down to a power of 2, so x * scale never exceeds fp8_max."""
    amax = amax.float()
    sf = fp8_max / amax
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, _FP32_MAX), sf)
    ok = (amax > 0.0) & torch.isfinite(amax)
    sf = torch.where(ok, sf, torch.ones_like(sf))
    return (sf.view(torch.int32) & -8388608).view(torch.float32)  # 0xFF800000


def e8m0_exponent(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """The biased E8M0 exponent of an MXFP8 tile, as TE's `float_to_e8m0(amax *
    max_norm_rcp)` (transformer_engine/common/utils.cuh; its portable branch, which the
    Blackwell `cvt.rp.satfinite.ue8m0x2.f32` matches): v = amax * fp32(1/fp8_max); the
    exponent field of v, plus one when v has mantissa bits (round towards +inf) unless
    that would pass 0xFE, or v is subnormal at most half of 2^-126; 0 -> 0, inf -> 0xFE,
    NaN -> 0xFF. Rounding up makes 2^(e-127) >= amax / fp8_max: no value saturates.

    The OCP MX spec v1.0 (section 6.3) instead takes X = 2^(floor(log2 amax) - emax_elem)
    (emax 8 for E4M3) and clamps the elements; megamoe follows TE, the implementation
    Megatron-LM runs (tests/model/test_fp8_blocks.py shows where the two differ)."""
    rcp = struct.unpack("f", struct.pack("f", 1.0 / fp8_max))[0]  # fp32(1/fp8_max)
    v = amax.float() * rcp  # an fp32 product (the scalar is cast to fp32): no host copy
    bits = v.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    exp = exp + up.to(exp.dtype)
    exp = torch.where(v == 0, torch.zeros_like(exp), exp)
    exp = torch.where(torch.isinf(v), torch.full_like(exp, 0xFE), exp)
    return torch.where(torch.isnan(v), torch.full_like(exp, 0xFF), exp)


def e8m0_scale_inv(exp: torch.Tensor) -> torch.Tensor:
    """2^(exp - 127) in fp32 (the E8M0 value; exp 0 is 2^-127, a subnormal fp32)."""
    return torch.ldexp(torch.ones_like(exp, dtype=torch.float32), (exp - 127).float())


def e8m0_encode(exp: torch.Tensor) -> torch.Tensor:
    """TE's exp2f_rcp: the factor the data is multiplied by, 2^(127 - exp), and 1 for
    exp 0 (a tile of zeros)."""
    f = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), (127 - exp).float())
    return torch.where(exp == 0, torch.ones_like(f), f)


@dataclass
class BlockQ:
    """A GEMM operand quantised in tiles: data [R, K] in FP8; scale_inv [ceil(R/tr),
    ceil(K/tk)] fp32 (x ~= data * scale_inv of its tile); tile (tr, tk)."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    tile: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """data * scale_inv in fp32 (what an exact block-scaled GEMM multiplies)."""
        r, k = self.data.shape
        tr, tk = self.tile
        s = self.scale_inv.repeat_interleave(tr, 0)[:r].repeat_interleave(tk, 1)[:, :k]
        return self.data.float() * s

    def t(self) -> BlockQ:
        """The transpose; exact only for square tiles (128x128 weight blocks)."""
        assert self.tile[0] == self.tile[1], "a 1-D tiling has no exact transpose"
        return BlockQ(self.data.t(), self.scale_inv.t(), self.tile)


def quantize_tiles(x_RK: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype,
                   recipe: str) -> BlockQ:
    """x in tiles of tile=(tr, tk) rows x columns (tk along K), each with its own scale
    under `recipe` (pow2_scale for blockwise and rowwise, E8M0 for mxfp8); values
    saturate at the format's max (TE casts with saturation); NaN stays NaN."""
    r, k = x_RK.shape
    tr, tk = tile
    nr, nk = max(1, math.ceil(r / tr)), max(1, math.ceil(k / tk))
    xf = x_RK.detach().float()
    padded = F.pad(xf, (0, nk * tk - k, 0, nr * tr - r))
    amax = padded.abs().reshape(nr, tr, nk, tk).amax(dim=(1, 3))
    fp8_max = FP8_MAX[dtype]
    if recipe == "mxfp8":
        exp = e8m0_exponent(amax, fp8_max)
        enc, scale_inv = e8m0_encode(exp), e8m0_scale_inv(exp)
    else:
        enc = pow2_scale(amax, fp8_max)
        scale_inv = 1.0 / enc  # exact: a power of 2
    full = enc.repeat_interleave(tr, 0)[:r].repeat_interleave(tk, 1)[:, :k]
    q = (xf * full).clamp(-fp8_max, fp8_max).to(dtype)
    return BlockQ(q, scale_inv, (tr, tk))


def operand_tile(recipe: str, k: int, weight: bool) -> tuple[int, int]:
    """The tile of a GEMM operand laid out [rows, K]: blockwise 1x128 (weights 128x128),
    mxfp8 1x32, rowwise one row (1 x K)."""
    if recipe == "blockwise":
        return (128, 128) if weight else (1, 128)
    if recipe == "mxfp8":
        return (1, 32)
    if recipe == "rowwise":
        return (1, max(1, k))
    raise ValueError(f"FP8 recipe {recipe!r} has no tiles")


def quantize_operand(x_RK: torch.Tensor, recipe: str, dtype: torch.dtype,
                     weight: bool = False) -> BlockQ:
    """One GEMM operand [rows, K] quantised for a contraction over K."""
    return quantize_tiles(x_RK, operand_tile(recipe, x_RK.shape[1], weight), dtype, recipe)
