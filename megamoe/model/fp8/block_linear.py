"""The FP8 linear and the experts' FP8 GEMM under the block-scaled recipes (blockwise,
mxfp8, rowwise: blocks.py), forward and both backward GEMMs, as Transformer Engine's
Linear / GroupedLinear under Float8BlockScaling and MXFP8BlockScaling.

Each GEMM's operands are tiled along its own contraction dimension, so an operand used by
two GEMMs is quantised twice from the high-precision tensor (TE's rowwise and columnwise
copies): the input x along K for the forward and along T for wgrad; the output gradient g
along N for dgrad and along T for wgrad; the weight along K for the forward and along N
for dgrad (a 128x128 block weight once: its transpose is exact). Autograd keeps the FP8
copies the backward needs (1 byte per value, plus the scales), not the high-precision
tensors. The GEMMs run on block_gemm.block_mm (the device's kernel, else the exact
quantise-dequantise reference).
"""

from __future__ import annotations

import torch

from megamoe.model.fp8.block_gemm import block_mm
from megamoe.model.fp8.blocks import BlockQ, quantize_operand


def _weight_t(w_NK: torch.Tensor, qw: BlockQ, recipe: str, dtype: torch.dtype) -> BlockQ:
    """The weight tiled along N (for dgrad): the exact transpose of 128x128 blocks, else
    quantised again from the high-precision weight."""
    if qw.tile[0] == qw.tile[1]:
        return qw.t()
    return quantize_operand(w_NK.t(), recipe, dtype, weight=True)


def _pack(*qs: BlockQ) -> list[torch.Tensor]:
    return [t for q in qs for t in (q.data, q.scale_inv)]


def _unpack(tensors, tiles) -> list[BlockQ]:
    return [BlockQ(tensors[2 * i], tensors[2 * i + 1], tile) for i, tile in enumerate(tiles)]


class _BlockFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK: torch.Tensor, w_NK: torch.Tensor, scaling):
        recipe, fwd = scaling.x.recipe, scaling.x.dtype
        qw = quantize_operand(w_NK, recipe, scaling.w.dtype, weight=True)
        y = block_mm(quantize_operand(x_TK, recipe, fwd), qw, x_TK.dtype, recipe)
        qx_t = quantize_operand(x_TK.t(), recipe, fwd)  # [K, T]: tiles along T
        qw_t = _weight_t(w_NK, qw, recipe, scaling.w.dtype)  # [K, N]: tiles along N
        ctx.save_for_backward(*_pack(qx_t, qw_t))
        ctx.tiles = (qx_t.tile, qw_t.tile)
        ctx.recipe, ctx.g_dtype = recipe, scaling.g.dtype
        ctx.x_dtype, ctx.w_dtype = x_TK.dtype, w_NK.dtype
        return y

    @staticmethod
    def backward(ctx, g_TN: torch.Tensor):
        qx_t, qw_t = _unpack(ctx.saved_tensors, ctx.tiles)
        r = ctx.recipe
        dx = dw = None
        if ctx.needs_input_grad[0]:  # [T, N] @ [N, K], contraction over N
            dx = block_mm(quantize_operand(g_TN, r, ctx.g_dtype), qw_t, ctx.x_dtype, r)
        if ctx.needs_input_grad[1]:  # [N, T] @ [T, K], contraction over T
            dw = block_mm(quantize_operand(g_TN.t(), r, ctx.g_dtype), qx_t, ctx.w_dtype, r)
        return dx, dw, None


def block_fp8_linear(x_TK: torch.Tensor, w_NK: torch.Tensor, scaling) -> torch.Tensor:
    """x [T, K] @ W [N, K]^T in FP8 under scaling's block recipe."""
    return _BlockFp8Linear.apply(x_TK, w_NK, scaling)


class _BlockFp8GroupedMM(torch.autograd.Function):
    """y_e = x_e @ W_e per expert (a loop: each expert's rows are tiled on their own, as
    TE's GroupedLinear quantises each split with its own quantizer)."""

    @staticmethod
    def forward(ctx, x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes: list[int], scaling):
        recipe, fwd, wd = scaling.x.recipe, scaling.x.dtype, scaling.w.dtype
        outs, saved, tiles = [], [], []
        for e, x_e in enumerate(x_NK.split(sizes)):
            if not sizes[e]:
                continue
            w_MK = w_EKM[e].t()
            qw = quantize_operand(w_MK, recipe, wd, weight=True)
            outs.append(block_mm(quantize_operand(x_e, recipe, fwd), qw, x_NK.dtype, recipe))
            qx_t = quantize_operand(x_e.t(), recipe, fwd)  # [K, n]: tiles along n
            qw_t = _weight_t(w_MK, qw, recipe, wd)  # [K, M]: tiles along M
            saved += _pack(qx_t, qw_t)
            tiles += [qx_t.tile, qw_t.tile]
        ctx.save_for_backward(*saved)
        ctx.tiles, ctx.sizes, ctx.recipe, ctx.g_dtype = tiles, sizes, recipe, scaling.g.dtype
        ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x_NK.dtype, w_EKM.dtype, w_EKM.shape
        if not outs:
            return x_NK.new_zeros(0, w_EKM.shape[2])
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, g_NM: torch.Tensor):
        qs = iter(_unpack(ctx.saved_tensors, ctx.tiles))
        r, gd = ctx.recipe, ctx.g_dtype
        E, K, M = ctx.w_shape
        dxs = []
        dw = torch.zeros(E, K, M, dtype=ctx.w_dtype, device=g_NM.device)
        for e, g_e in enumerate(g_NM.split(ctx.sizes)):
            if not ctx.sizes[e]:
                continue
            qx_t, qw_t = next(qs), next(qs)
            dxs.append(block_mm(quantize_operand(g_e, r, gd), qw_t, ctx.x_dtype, r))
            dw[e] = block_mm(qx_t, quantize_operand(g_e.t(), r, gd), ctx.w_dtype, r)
        dx = torch.cat(dxs) if dxs else g_NM.new_zeros(0, K, dtype=ctx.x_dtype)
        return dx, dw, None, None


def block_fp8_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes: list[int],
                         scaling) -> torch.Tensor:
    """Rows grouped by expert @ that expert's [K, M] weight, in FP8 under a block recipe."""
    return _BlockFp8GroupedMM.apply(x_NK, w_EKM, list(sizes), scaling)
