"""The experts' FP8 grouped GEMM: y_e = x_e @ W_e for the rows x_e of each local expert,
forward and both backward GEMMs on torch._scaled_mm, one scale per expert and operand
(as TE's GroupedLinear: one quantizer per GEMM).

It runs as a loop of per-expert scaled GEMMs; the group sizes are read on the host once per
call (as the grouped-GEMM loop backend). torch._scaled_grouped_mm (CUDA SM90, row-wise
scales) is not wired in yet: docs/fp8.md.
"""

from __future__ import annotations

import torch

from megamoe.model.fp8.linear import LinearScaling, scaled_mm
from megamoe.model.fp8.quantize import amax_of, quantize


def _row_scales(scale_E: torch.Tensor, sizes: list[int], num_rows: int) -> torch.Tensor:
    """Expert e's scale repeated over its rows: [N, 1] (built on the device from the
    host sizes: no host-to-device copy)."""
    if num_rows == 0:
        return scale_E.new_ones(0, 1)
    return torch.cat([scale_E[e].expand(n) for e, n in enumerate(sizes) if n]).unsqueeze(-1)


def _quantize_rows(meta, x_NK: torch.Tensor, sizes: list[int]):
    """Each expert's rows quantised with that expert's scale: (FP8 rows, scales [E])."""
    amax_E = torch.stack([amax_of(c) for c in x_NK.split(sizes)])
    scale_E = meta.scale_for(amax_E)
    return quantize(x_NK, _row_scales(scale_E, sizes, x_NK.shape[0]), meta.dtype), scale_E


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes: list[int],
                scaling: LinearScaling):
        qx, sx = _quantize_rows(scaling.x, x_NK, sizes)
        amax_w = w_EKM.detach().abs().amax(dim=(1, 2)).float()
        sw = scaling.w.scale_for(amax_w)
        qw = quantize(w_EKM, sw.view(-1, 1, 1), scaling.w.dtype)
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.sizes, ctx.scaling = sizes, scaling
        ctx.x_dtype, ctx.w_dtype = x_NK.dtype, w_EKM.dtype
        out = [scaled_mm(q, sx[e], qw[e], sw[e], x_NK.dtype)
               for e, q in enumerate(qx.split(sizes)) if sizes[e]]
        if not out:
            return x_NK.new_zeros(0, w_EKM.shape[2])
        return torch.cat(out)

    @staticmethod
    def backward(ctx, g_NM: torch.Tensor):
        qx, sx, qw, sw = ctx.saved_tensors
        sizes = ctx.sizes
        qg, sg = _quantize_rows(ctx.scaling.g, g_NM.contiguous(), sizes)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            parts = [scaled_mm(q, sg[e], qw[e].t(), sw[e], ctx.x_dtype)
                     for e, q in enumerate(qg.split(sizes)) if sizes[e]]
            dx = torch.cat(parts) if parts else g_NM.new_zeros(0, qw.shape[1], dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            E, K, M = qw.shape
            dw = torch.zeros(E, K, M, dtype=ctx.w_dtype, device=qw.device)
            for e, (q_x, q_g) in enumerate(zip(qx.split(sizes), qg.split(sizes))):
                if sizes[e]:
                    dw[e] = scaled_mm(q_x.t(), sx[e], q_g, sg[e], ctx.w_dtype)
        return dx, dw, None, None


def fp8_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes: list[int],
                   scaling: LinearScaling) -> torch.Tensor:
    """Rows grouped by expert (sizes[e] rows of expert e, in order) @ that expert's
    [K, M] weight, in FP8."""
    return _Fp8GroupedMM.apply(x_NK, w_EKM, list(sizes), scaling)
