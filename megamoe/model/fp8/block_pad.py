"""An expert's block-scaled GEMMs padded to the kernel's alignment with zero rows.

An expert's row count n_e is whatever the router gave it, and the block-scaled kernels
want every dimension a multiple of their alignment (block_gemm.kernel_multiple: 128 for
blockwise and mxfp8, 16 for rowwise on CUDA), so without padding almost every expert GEMM
ran the reference. Zero rows change no tile's amax and quantise to zero, so padding the
quantised operand equals quantising the zero-padded tensor (pad_block; shown bitwise by
tests/model/test_fp8_expert_kernels.py) and the GEMM gains only zeros: the forward's and
dgrad's padded output rows are dropped; wgrad's contraction over the rows adds zero
products. Padding happens per expert GEMM (at most multiple-1 rows each, FP8 bytes: no
[E, max_n, K] buffer) and only where a kernel will take the padded GEMM; the CPU path is
unchanged.
"""

from __future__ import annotations

import functools
import math

import torch

from megamoe.model.fp8.block_gemm import block_mm, kernel_multiple
from megamoe.model.fp8.blocks import BlockQ, quantize_tiles


@functools.cache
def zero_tile_scale_inv(recipe: str, dtype: torch.dtype) -> float:
    """The scale_inv quantize_tiles gives a tile of zeros under this recipe (1 for the
    power-of-2 recipes, 2^-127 for mxfp8's E8M0 exponent 0): what a padded tile holds."""
    # a host constant (a Python float), computed once per recipe: no device sync
    zero = torch.zeros(1, 1, device="cpu")
    return quantize_tiles(zero, (1, 1), dtype, recipe).scale_inv.item()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_block(q: BlockQ, rows: int, cols: int, recipe: str) -> BlockQ:
    """q [r, k] as the quantisation of its tensor zero-padded to [rows, cols]: FP8 zeros,
    the zero tile's scale in new tiles; a row-wise tile (1 x k) widens to 1 x cols (its
    amax, hence its scale, is unchanged)."""
    r, k = q.data.shape
    tr, tk = q.tile
    if recipe == "rowwise":
        tk = max(1, cols)
    data = q.data.new_zeros(rows, cols)
    data[:r, :k] = q.data
    shape = (max(1, math.ceil(rows / tr)), max(1, math.ceil(cols / tk)))
    scale = q.scale_inv.new_full(shape, zero_tile_scale_inv(recipe, q.data.dtype))
    sr, sk = min(shape[0], q.scale_inv.shape[0]), min(shape[1], q.scale_inv.shape[1])
    scale[:sr, :sk] = q.scale_inv[:sr, :sk]
    return BlockQ(data, scale, (tr, tk))


def expert_mm(a: BlockQ, b: BlockQ, out_dtype: torch.dtype, recipe: str) -> torch.Tensor:
    """a [n, K] @ b [M, K]^T for an expert's n rows (forward, dgrad): a's rows padded to
    the kernel's multiple where that lets the kernel run, the padded rows dropped."""
    n, k = a.data.shape
    mult = kernel_multiple(recipe, a, b, out_dtype)
    if mult == 1 or n % mult == 0 or k % mult or b.data.shape[0] % mult:
        return block_mm(a, b, out_dtype, recipe)
    return block_mm(pad_block(a, round_up(n, mult), k, recipe), b, out_dtype, recipe)[:n]


def expert_wgrad_mm(a: BlockQ, b: BlockQ, out_dtype: torch.dtype, recipe: str) -> torch.Tensor:
    """a [K, n] @ b [M, n]^T, the contraction over an expert's n rows (wgrad): both
    operands padded with zero columns where that lets the kernel run."""
    (k, n), m = a.data.shape, b.data.shape[0]
    mult = kernel_multiple(recipe, a, b, out_dtype)
    if mult == 1 or n % mult == 0 or k % mult or m % mult:
        return block_mm(a, b, out_dtype, recipe)
    cols = round_up(n, mult)
    return block_mm(pad_block(a, k, cols, recipe), pad_block(b, m, cols, recipe),
                    out_dtype, recipe)
