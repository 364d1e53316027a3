"""The experts' FP8 grouped GEMM: y_e = x_e @ W_e for the rows x_e of each local expert,
forward and both backward GEMMs on torch._scaled_mm, one scale per expert and operand
(as TE's GroupedLinear: one quantizer per GEMM).

Each of the three GEMMs runs as one torch._scaled_grouped_mm where the device has it
(CUDA sm90, both operands E4M3, bf16 output, K and M multiples of 16; checked once by a
probe against the loop: grouped_kernel_ok), with each expert's per-tensor scale broadcast
over its rows / columns (the same products as the loop); otherwise as a loop of
per-expert scaled GEMMs (the CPU; E5M2 gradients under hybrid). The group sizes are read on
the host once per call (as the grouped-GEMM loop backend). The block-scaled recipes run
block_linear.block_fp8_grouped_mm instead.
"""

from __future__ import annotations

import torch

from megamoe.model.fp8.block_gemm import agrees, device_capability, probed
from megamoe.model.fp8.block_linear import block_fp8_grouped_mm
from megamoe.model.fp8.blocks import BLOCK_RECIPES
from megamoe.model.fp8.linear import LinearScaling, scaled_mm
from megamoe.model.fp8.quantize import E4M3, amax_of, quantize
from megamoe.model.fp8.rowwise_grouped import group_offsets, padded_group_sizes


def _scaled_grouped_mm(*args, **kwargs):
    """torch's grouped FP8 GEMM (a name tests can replace with a CPU stand-in)."""
    return torch._scaled_grouped_mm(*args, **kwargs)


def _kernel_ok(device: torch.device) -> bool:
    """torch._scaled_grouped_mm here: CUDA sm90 (its row-wise FP8 kernel), and a probe
    against the loop passed once per device."""
    if device_capability(device) != (9, 0) or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return probed(("scaled_grouped_mm", device), lambda: _probe(device),
                  lambda: f"FP8 experts: torch._scaled_grouped_mm failed its probe on "
                          f"{device}; the per-expert loop runs there")


def grouped_kernel_ok(device: torch.device, a_dtype, b_dtype, out_dtype, *dims: int) -> bool:
    """Whether one of the experts' GEMMs runs on torch._scaled_grouped_mm: E4M3 operands
    (its only FP8 type), bf16 output (row-wise scaling's only one), dims multiples of 16."""
    return (a_dtype == E4M3 and b_dtype == E4M3 and out_dtype == torch.bfloat16
            and all(d % 16 == 0 for d in dims) and _kernel_ok(device))


def _probe(device: torch.device) -> bool:
    """The forward of two experts (16 and 32 rows, K = M = 32) on the kernel and on the
    loop; any error or a difference beyond bf16 rounding means no."""
    # host draws (the same values on every device), once per device, then moved
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(48, 32, generator=gen, device="cpu").to(device).to(E4M3)  # (host draw)
    w = torch.randn(2, 32, 32, generator=gen, device="cpu").to(device).to(E4M3)  # (host draw)
    sx, sw = torch.tensor([2.0, 0.5], device=device), torch.tensor([0.25, 4.0], device=device)
    try:
        got = _kernel_fwd(x, sx, w, sw, [16, 32], torch.bfloat16).float()
    except Exception:  # noqa: BLE001 - any failure (build, layout, device) means "no"
        return False
    ref = torch.cat([(x[lo:hi].float() / sx[e]) @ (w[e].float() / sw[e])
                     for e, (lo, hi) in enumerate([(0, 16), (16, 48)])])
    return agrees(got, ref)


def _kernel_fwd(q_NK, s_E, q_EKM, sw_E, sizes, out_dtype):
    """[rows of e] @ W_e (decode scales 1/s per expert, broadcast to row-wise)."""
    one = torch.ones((), device=q_NK.device)
    rows = (one / _row_scales(s_E, sizes, q_NK.shape[0])).reshape(-1).contiguous()
    cols = (one / sw_E).unsqueeze(1).expand(-1, q_EKM.shape[2]).contiguous()
    b = q_EKM.transpose(1, 2).contiguous().transpose(1, 2)  # column-major per expert
    return _scaled_grouped_mm(q_NK.contiguous(), b, rows, cols,
                              offs=group_offsets(sizes, q_NK.device), out_dtype=out_dtype)


def _kernel_wgrad(qx_NK, sx_E, qg_NM, sg_E, sizes, out_dtype):
    """dW_e = x_e^T @ g_e for every expert at once (2-D x 2-D, groups along the rows).
    torch's kernel asserts on the device that these groups are multiples of 16 (16 bytes
    of FP8; aten/src/ATen/native/cuda/GroupMMCommon.cuh): each expert's rows are padded
    with zero rows to that, which add nothing to its contraction; an empty expert gets 16
    zero rows, so its dW comes from a GEMM of zeros, not a K = 0 GEMM."""
    one = torch.ones((), device=qx_NK.device)
    E, K, M = len(sizes), qx_NK.shape[1], qg_NM.shape[1]
    sa = (one / sx_E).unsqueeze(1).expand(E, K).reshape(-1).contiguous()
    sb = (one / sg_E).unsqueeze(1).expand(E, M).reshape(-1).contiguous()
    padded = padded_group_sizes(sizes)
    qx, qg = _pad_groups(qx_NK, sizes, padded), _pad_groups(qg_NM, sizes, padded)
    return _scaled_grouped_mm(qx.t().contiguous(), qg.t().contiguous().t(), sa, sb,
                              offs=group_offsets(padded, qx_NK.device), out_dtype=out_dtype)


def _pad_groups(q_NK: torch.Tensor, sizes: list[int], padded: list[int]) -> torch.Tensor:
    """Each group's rows followed by zero rows up to its padded count (FP8 bytes)."""
    parts = []
    for chunk, n, p in zip(q_NK.split(sizes), sizes, padded):
        parts += [chunk, q_NK.new_zeros(p - n, q_NK.shape[1])]
    return torch.cat(parts)


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
                scaling: LinearScaling, fp8_w):
        qx, sx = _quantize_rows(scaling.x, x_NK, sizes)
        if fp8_w is None:
            amax_w = w_EKM.detach().abs().amax(dim=(1, 2)).float()
            sw = scaling.w.scale_for(amax_w)
            qw = quantize(w_EKM, sw.view(-1, 1, 1), scaling.w.dtype)
        else:  # an FP8 primary weight (--fp8-param-gather): quantised by the optimizer
            qw, sw = fp8_w
        # --no-fp8-wgrad: wgrad needs the high-precision rows, not the FP8 ones
        ctx.save_for_backward(qx if scaling.fp8_wgrad else x_NK.detach(), sx, qw, sw)
        ctx.sizes, ctx.scaling = sizes, scaling
        ctx.x_dtype, ctx.w_dtype = x_NK.dtype, w_EKM.dtype
        E, K, M = w_EKM.shape
        if grouped_kernel_ok(x_NK.device, qx.dtype, qw.dtype, x_NK.dtype, K, M):
            return _kernel_fwd(qx, sx, qw, sw, sizes, x_NK.dtype)
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
        E, K, M = qw.shape
        dev = g_NM.device
        if ctx.needs_input_grad[0] and grouped_kernel_ok(dev, qg.dtype, qw.dtype, ctx.x_dtype,
                                                         K, M):
            dx = _kernel_fwd(qg, sg, qw.transpose(1, 2), sw, sizes, ctx.x_dtype)
        elif ctx.needs_input_grad[0]:
            parts = [scaled_mm(q, sg[e], qw[e].t(), sw[e], ctx.x_dtype)
                     for e, q in enumerate(qg.split(sizes)) if sizes[e]]
            dx = torch.cat(parts) if parts else g_NM.new_zeros(0, qw.shape[1], dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1] and not ctx.scaling.fp8_wgrad:
            dw = _high_precision_wgrad(qx, g_NM, sizes, E, ctx.w_dtype)
        elif ctx.needs_input_grad[1] and grouped_kernel_ok(dev, qx.dtype, qg.dtype,
                                                           ctx.w_dtype, K, M):
            dw = _kernel_wgrad(qx, sx, qg, sg, sizes, ctx.w_dtype)
        elif ctx.needs_input_grad[1]:
            dw = torch.zeros(E, K, M, dtype=ctx.w_dtype, device=qw.device)
            for e, (q_x, q_g) in enumerate(zip(qx.split(sizes), qg.split(sizes))):
                if sizes[e]:
                    dw[e] = scaled_mm(q_x.t(), sx[e], q_g, sg[e], ctx.w_dtype)
        return dx, dw, None, None, None


def _high_precision_wgrad(x_NK: torch.Tensor, g_NM: torch.Tensor, sizes: list[int],
                          num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """dW_e = x_e^T @ g_e in the operands' precision (--no-fp8-wgrad), zero for an expert
    without rows."""
    dw = torch.zeros(num_experts, x_NK.shape[1], g_NM.shape[1], dtype=dtype,
                     device=x_NK.device)
    for e, (x_e, g_e) in enumerate(zip(x_NK.split(sizes), g_NM.split(sizes))):
        if sizes[e]:
            dw[e] = (x_e.t() @ g_e).to(dtype)
    return dw


def fp8_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes: list[int],
                   scaling: LinearScaling, fp8_w=None) -> torch.Tensor:
    """Rows grouped by expert (sizes[e] rows of expert e, in order) @ that expert's
    [K, M] weight, in FP8. `fp8_w`: (FP8 weight [E, K, M], scales [E]) of an FP8 primary
    weight (model/fp8/params.py), read as it is."""
    if scaling.x.recipe in BLOCK_RECIPES:
        if fp8_w is not None and scaling.x.recipe != "blockwise":
            raise ValueError(f"--fp8-param-gather is not built for --fp8-recipe "
                             f"{scaling.x.recipe}")
        if not scaling.fp8_wgrad:
            raise ValueError(f"--no-fp8-wgrad is not built for --fp8-recipe {scaling.x.recipe}")
        return block_fp8_grouped_mm(x_NK, w_EKM, sizes, scaling, fp8_w)
    return _Fp8GroupedMM.apply(x_NK, w_EKM, list(sizes), scaling, fp8_w)
