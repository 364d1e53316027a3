"""The FP8 linear: y = x @ W^T with its forward GEMM and both backward GEMMs (dgrad
dx = g @ W, wgrad dW = g^T @ x) on torch._scaled_mm, as Transformer Engine's Linear.

Inputs and weights are quantised to the recipe's forward dtype (E4M3), output gradients to
its backward dtype (E4M3, or E5M2 under hybrid); each operand has its own scale
(scaling.Fp8Meta). The GEMMs accumulate in fp32 and write the input's dtype; the bias is
added (and its gradient summed) in that precision. Autograd keeps the FP8 input and weight
(1 byte per value) with their scales, not the high-precision copies. The block-scaled
recipes (blockwise, mxfp8, rowwise) run block_linear.py instead (fp8_linear dispatches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megamoe.model.fp8.block_linear import block_fp8_linear
from megamoe.model.fp8.blocks import BLOCK_RECIPES
from megamoe.model.fp8.quantize import amax_of, quantize
from megamoe.model.fp8.scaling import Fp8Meta


@dataclass
class LinearScaling:
    """The scaling of one FP8 GEMM's three operands: input, weight, output gradient.
    `fp8_wgrad` False (--no-fp8-wgrad, TE's override_linear_precision (False, False,
    True)): the weight-gradient GEMM runs in the input's precision on the unquantised
    input and output gradient; forward and dgrad stay FP8."""
    x: Fp8Meta
    w: Fp8Meta
    g: Fp8Meta
    fp8_wgrad: bool = True

    def metas(self) -> list[Fp8Meta]:
        return [self.x, self.w, self.g]


def _aligned(*dims: int) -> bool:
    return all(d % 16 == 0 for d in dims)


def scaled_mm(a_MK: torch.Tensor, sa: torch.Tensor, b_KN: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a / sa) @ (b / sb) for FP8 a, b with scalar scales, fp32 accumulation, in
    `out_dtype`. CUDA's kernel wants a row-major, b column-major and every dimension a
    multiple of 16; a GEMM that is not is computed from the dequantised FP8 values (the same
    products, another accumulation order)."""
    m, k = a_MK.shape
    n = b_KN.shape[1]
    if a_MK.is_cuda and not _aligned(m, k, n):
        return ((a_MK.float() / sa) @ (b_KN.float() / sb)).to(out_dtype)
    a = a_MK.contiguous()
    b = b_KN.t().contiguous().t()  # column-major
    one = torch.ones((), device=a.device)
    return torch._scaled_mm(a, b, scale_a=(one / sa).reshape(()), scale_b=(one / sb).reshape(()),
                            out_dtype=out_dtype)


def quantize_with(meta: Fp8Meta, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (FP8 x, its scale [1]) under meta's recipe (slot 0)."""
    scale = meta.scale_for(amax_of(x).reshape(1))
    return quantize(x, scale, meta.dtype), scale


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK: torch.Tensor, w_NK: torch.Tensor, scaling: LinearScaling,
                fp8_w: Optional[tuple[torch.Tensor, torch.Tensor]]):
        qx, sx = quantize_with(scaling.x, x_TK)
        # an FP8 primary weight (--fp8-param-gather) is already quantised: read as it is
        qw, sw = quantize_with(scaling.w, w_NK) if fp8_w is None else fp8_w
        # --no-fp8-wgrad: wgrad needs the high-precision input, not the FP8 one
        ctx.save_for_backward(qx if scaling.fp8_wgrad else x_TK.detach(), sx, qw, sw)
        ctx.scaling, ctx.x_dtype, ctx.w_dtype = scaling, x_TK.dtype, w_NK.dtype
        return scaled_mm(qx, sx, qw.t(), sw, x_TK.dtype)

    @staticmethod
    def backward(ctx, g_TN: torch.Tensor):
        saved_x, sx, qw, sw = ctx.saved_tensors
        qg, sg = quantize_with(ctx.scaling.g, g_TN)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_mm(qg, sg, qw, sw, ctx.x_dtype)  # [T, N] @ [N, K]
        if ctx.needs_input_grad[1] and ctx.scaling.fp8_wgrad:
            dw = scaled_mm(qg.t(), sg, saved_x, sx, ctx.w_dtype)  # [N, T] @ [T, K]
        elif ctx.needs_input_grad[1]:
            dw = (g_TN.t() @ saved_x).to(ctx.w_dtype)
        return dx, dw, None, None


def fp8_linear(x: torch.Tensor, weight_NK: torch.Tensor, bias: Optional[torch.Tensor],
               scaling: LinearScaling,
               fp8_w: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with the GEMMs in FP8; x is [..., K]. `fp8_w`: the
    weight already in FP8 with its scale (an FP8 primary weight, model/fp8/params.py);
    `weight_NK` then only carries the gradient."""
    lead = x.shape[:-1]
    x_TK = x.reshape(-1, x.shape[-1])
    if scaling.x.recipe in BLOCK_RECIPES:
        if not scaling.fp8_wgrad:
            raise ValueError(f"--no-fp8-wgrad is not built for --fp8-recipe {scaling.x.recipe}")
        if fp8_w is not None and scaling.x.recipe != "blockwise":
            raise ValueError(f"--fp8-param-gather is not built for --fp8-recipe "
                             f"{scaling.x.recipe}")
        y = block_fp8_linear(x_TK, weight_NK, scaling, fp8_w)
    else:
        y = _Fp8Linear.apply(x_TK, weight_NK, scaling, fp8_w)
    y = y.reshape(*lead, weight_NK.shape[0])
    return y if bias is None else y + bias


def linear(x: torch.Tensor, weight_NK: torch.Tensor, bias: Optional[torch.Tensor],
           scaling: Optional[LinearScaling]) -> torch.Tensor:
    """The layers' one linear: FP8 when the policy gave the layer a scaling, else F.linear."""
    if scaling is None:
        return torch.nn.functional.linear(x, weight_NK, bias)
    return fp8_linear(x, weight_NK, bias, scaling)
