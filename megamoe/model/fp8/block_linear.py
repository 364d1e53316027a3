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
quantise-dequantise reference); the experts' GEMMs padded to the kernel's alignment
(block_pad.py) or, under rowwise on sm90, on torch._scaled_grouped_mm (rowwise_grouped.py).
"""

from __future__ import annotations

import torch

from megamoe.model.fp8 import rowwise_grouped
from megamoe.model.fp8.block_gemm import block_mm
from megamoe.model.fp8.block_pad import expert_mm, expert_wgrad_mm
from megamoe.model.fp8.blocks import BlockQ, quantize_operand


def _weight_t(w_NK: torch.Tensor, qw: BlockQ, recipe: str, dtype: torch.dtype) -> BlockQ:
    """The weight tiled along N (for dgrad): the exact transpose of 128x128 blocks, else
    quantised again from the high-precision weight."""
    if qw.tile[0] == qw.tile[1]:
        return qw.t()
    return quantize_operand(w_NK.t(), recipe, dtype, weight=True)


def primary_blocks(data: torch.Tensor, scale: torch.Tensor) -> BlockQ:
    """An FP8 primary weight (--fp8-param-gather, blockwise) [R, C] with its 128x128
    block scales (flat, x ~= data / scale) as the forward's operand."""
    r, c = data.shape
    grid = (-(-r // 128), -(-c // 128))
    return BlockQ(data, (1.0 / scale).view(grid), (128, 128))  # exact: powers of 2


def _pack(*qs: BlockQ) -> list[torch.Tensor]:
    return [t for q in qs for t in (q.data, q.scale_inv)]


def _unpack(tensors, tiles) -> list[BlockQ]:
    return [BlockQ(tensors[2 * i], tensors[2 * i + 1], tile) for i, tile in enumerate(tiles)]


class _BlockFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK: torch.Tensor, w_NK: torch.Tensor, scaling, fp8_w):
        recipe, fwd = scaling.x.recipe, scaling.x.dtype
        qw = (quantize_operand(w_NK, recipe, scaling.w.dtype, weight=True) if fp8_w is None
              else primary_blocks(*fp8_w))  # an FP8 primary weight: as the optimizer cast it
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
        return dx, dw, None, None


def block_fp8_linear(x_TK: torch.Tensor, w_NK: torch.Tensor, scaling,
                     fp8_w=None) -> torch.Tensor:
    """x [T, K] @ W [N, K]^T in FP8 under scaling's block recipe; `fp8_w`: (FP8 weight,
    block scales) of an FP8 primary weight (blockwise only)."""
    return _BlockFp8Linear.apply(x_TK, w_NK, scaling, fp8_w)


class _BlockFp8GroupedMM(torch.autograd.Function):
    """y_e = x_e @ W_e per expert: each expert's rows tiled on their own (TE's GroupedLinear
    quantises each split with its own quantizer). Each GEMM is a loop of per-expert GEMMs
    padded to the kernel's alignment (block_pad.py), or under rowwise one
    torch._scaled_grouped_mm (rowwise_grouped.py) where the device has it."""

    @staticmethod
    def forward(ctx, x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes: list[int], scaling,
                fp8_w):
        recipe, fwd, wd = scaling.x.recipe, scaling.x.dtype, scaling.w.dtype
        E, K, M = w_EKM.shape
        if fp8_w is None:
            qws = [quantize_operand(w_EKM[e].t(), recipe, wd, weight=True) for e in range(E)]
        else:  # an FP8 primary weight: each expert's [K, M] blocks, transposed (exact)
            data, scale = fp8_w
            qws = [primary_blocks(data[e], s).t() for e, s in enumerate(scale.chunk(E))]
        xs, live = x_NK.split(sizes), [e for e in range(E) if sizes[e]]
        saved = [q for e in live for q in (quantize_operand(xs[e].t(), recipe, fwd),  # [K, n]
                                           _weight_t(w_EKM[e].t(), qws[e], recipe, wd))]
        ctx.save_for_backward(*_pack(*saved))  # experts with rows only
        ctx.tiles = [q.tile for q in saved]
        ctx.sizes, ctx.recipe, ctx.fp8 = sizes, recipe, (fwd, wd, scaling.g.dtype)
        ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x_NK.dtype, w_EKM.dtype, w_EKM.shape
        qx = quantize_operand(x_NK, recipe, fwd)  # 1-row tiles: each expert's own
        if live and rowwise_grouped.usable(recipe, x_NK.device, fwd, wd, x_NK.dtype, K, M):
            return rowwise_grouped.rows_mm(qx, qws, sizes, x_NK.dtype)
        outs = [expert_mm(q, qws[e], x_NK.dtype, recipe)
                for e, q in enumerate(_row_slices(qx, sizes)) if sizes[e]]
        return torch.cat(outs) if outs else x_NK.new_zeros(0, M)

    @staticmethod
    def backward(ctx, g_NM: torch.Tensor):
        r, sizes, (xd, wd, gd) = ctx.recipe, ctx.sizes, ctx.fp8
        E, K, M = ctx.w_shape
        qx_ts, qw_ts = _per_expert(_unpack(ctx.saved_tensors, ctx.tiles), sizes, K, M, r,
                                   ctx.fp8, g_NM.device)
        gs, rows = g_NM.split(sizes), g_NM.shape[0] > 0
        qg = quantize_operand(g_NM, r, gd)  # 1-row tiles: each expert's own
        if rows and rowwise_grouped.usable(r, g_NM.device, gd, wd, ctx.x_dtype, K, M):
            dx = rowwise_grouped.rows_mm(qg, qw_ts, sizes, ctx.x_dtype)
        else:
            dxs = [expert_mm(q, qw_ts[e], ctx.x_dtype, r)
                   for e, q in enumerate(_row_slices(qg, sizes)) if sizes[e]]
            dx = torch.cat(dxs) if dxs else g_NM.new_zeros(0, K, dtype=ctx.x_dtype)
        qg_ts = [quantize_operand(g_e.t(), r, gd) for g_e in gs]  # [M, n]: along n
        if rows and rowwise_grouped.usable(r, g_NM.device, xd, gd, ctx.w_dtype, K, M):
            return dx, rowwise_grouped.wgrad_mm(qx_ts, qg_ts, r, ctx.w_dtype), None, None, None
        dw = torch.zeros(E, K, M, dtype=ctx.w_dtype, device=g_NM.device)
        for e in range(E):
            if sizes[e]:
                dw[e] = expert_wgrad_mm(qx_ts[e], qg_ts[e], ctx.w_dtype, r)
        return dx, dw, None, None, None


def _row_slices(q: BlockQ, sizes: list[int]) -> list[BlockQ]:
    """Each expert's rows of an operand tiled along K in one-row tiles (x, g: 1x128, 1x32,
    1xK): a tile never spans two rows, so these are exactly the per-expert quantisations
    (one quantisation instead of E)."""
    assert q.tile[0] == 1
    out, lo = [], 0
    for n in sizes:
        out.append(BlockQ(q.data[lo:lo + n], q.scale_inv[lo:lo + n], q.tile))
        lo += n
    return out


def _per_expert(saved: list[BlockQ], sizes: list[int], K: int, M: int, recipe: str,
                fp8: tuple, device: torch.device) -> tuple[list[BlockQ], list[BlockQ]]:
    """The saved (x^T, W^T) pairs of the experts with rows, as lists over every expert:
    an expert without rows gets x^T [K, 0] and a zero W^T (no row reads it)."""
    pairs = iter(zip(saved[0::2], saved[1::2]))
    qx_ts, qw_ts = [], []
    for n in sizes:
        if n:
            qx_t, qw_t = next(pairs)
        else:
            zeros = torch.zeros(K, M, device=device)
            qx_t = quantize_operand(zeros[:, :0], recipe, fp8[0])
            qw_t = quantize_operand(zeros, recipe, fp8[1], weight=True)
        qx_ts.append(qx_t)
        qw_ts.append(qw_t)
    return qx_ts, qw_ts


def block_fp8_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes: list[int],
                         scaling, fp8_w=None) -> torch.Tensor:
    """Rows grouped by expert @ that expert's [K, M] weight, in FP8 under a block recipe;
    `fp8_w`: (FP8 weight, block scales) of an FP8 primary weight (blockwise only)."""
    return _BlockFp8GroupedMM.apply(x_NK, w_EKM, list(sizes), scaling, fp8_w)
