"""The GPU self-test's FP8 checks (tools/gpu_selftest.py fp8 / fp8-recipes).

On a GPU the FP8 GEMMs run on CUDA kernels that no CPU test can run: torch._scaled_mm with
tensor-wise and row-wise scales (sm89+), block scales (1x128 / 128x128, sm90), MXFP8 (1x32
E8M0, sm100) and torch._scaled_grouped_mm for the experts (sm90). megamoe probes each
kernel once and falls back to the exact quantise-dequantise reference when the probe fails
(model/fp8/block_gemm.py), with a warning: a run would then be right but slow. This check
makes that fallback a FAIL: for every recipe the device supports, the kernel must be the
one chosen, and its GEMM on quantised operands must equal the reference's (fp32 products
of the dequantised values) to bf16 output rounding plus accumulation order, the probe's
bound: |got - ref| <= 2^-7 |ref| + 1e-3 max |ref|.

Which recipe needs which device (NVIDIA's FP8 support; torch's kernels at 2.13):
tensorwise and rowwise sm89+, blockwise sm90 only (torch's 1x128 / 128x128 kernel is
Hopper's), mxfp8 sm100 (Blackwell's block-scaled tensor cores). On the CPU the same
functions run tensorwise and rowwise on torch's CPU _scaled_mm (tests use that).
"""

from __future__ import annotations

from typing import Optional

import torch

from megamoe.model.fp8 import block_gemm
from megamoe.model.fp8.blocks import quantize_operand
from megamoe.model.fp8.linear import scaled_mm
from megamoe.model.fp8.quantize import E4M3, FP8_MAX

E4M3_MAX = FP8_MAX[E4M3]


def supported_recipes(capability: Optional[tuple[int, int]]) -> list[str]:
    """The FP8 recipes whose kernels a device of `capability` has (None: the CPU, where
    torch's _scaled_mm runs tensor-wise and row-wise scales)."""
    if capability is None:
        return ["tensorwise", "rowwise"]
    out = ["tensorwise", "rowwise"] if capability >= (8, 9) else []
    if capability == (9, 0):
        out.append("blockwise")
    if capability[0] == 10:
        out.append("mxfp8")
    return out


def _within(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error as a fraction of the bound (<= 1 passes)."""
    bound = 2.0 ** -7 * ref.abs() + 1e-3 * ref.abs().max()
    return float(((got.float() - ref).abs() / bound).max())


def _tensorwise(x: torch.Tensor, w: torch.Tensor) -> float:
    sx, sw = (E4M3_MAX / t.abs().amax().reshape(1) for t in (x, w))
    qx, qw = ((t * s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3) for t, s in ((x, sx), (w, sw)))
    got = scaled_mm(qx, sx, qw.t(), sw, torch.bfloat16)
    ref = (qx.float() / sx) @ (qw.float() / sw).t()
    return _within(got, ref)


def _block(recipe: str, x: torch.Tensor, w: torch.Tensor,
           weight: bool = True) -> tuple[float, bool]:
    """(error fraction, whether the device's kernel ran rather than the reference); b
    tiled as a weight (the forward and dgrad pairing) or as an activation (wgrad's)."""
    qa = quantize_operand(x, recipe, E4M3)
    qb = quantize_operand(w, recipe, E4M3, weight=weight)
    kernel = block_gemm._kernel_for(recipe, qa, qb, torch.bfloat16)
    got = block_gemm.block_mm(qa, qb, torch.bfloat16, recipe)
    status = block_gemm.KERNEL_STATUS.get(block_gemm.kernel_key(recipe, qa, qb), True)
    used = kernel is not None and status
    return _within(got, block_gemm.reference_mm(qa, qb, torch.float32)), used


def fp8_kernel_report(device: torch.device, recipes: list[str]) -> tuple[dict, bool]:
    """Each recipe's GEMM on `device` (256 x 512 @ 512 x 384, every dim a multiple of
    128) against the reference; on CUDA sm90 also whether the experts' grouped kernel
    passed its probes (tensorwise's, and rowwise's when rowwise is asked for). ok: every
    error within the bound and every kernel in use."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(256, 512, generator=gen).to(device)
    w = torch.randn(384, 512, generator=gen).to(device) * 0.05
    report: dict = {}
    ok = True
    for recipe in recipes:
        if recipe == "tensorwise":
            err, used = _tensorwise(x, w), True
        else:
            err, used = _block(recipe, x, w)
        report[recipe] = {"error_over_bound": err, "kernel": used}
        ok &= err <= 1.0 and used
        if recipe == "blockwise":  # wgrad's 1x128 x 1x128 pairing is a kernel of its own
            err, used = _block(recipe, x, w, weight=False)
            report["blockwise_1x128_1x128"] = {"error_over_bound": err, "kernel": used}
            ok &= err <= 1.0 and used
    if block_gemm.device_capability(device) == (9, 0):
        from megamoe.model.fp8.grouped import _kernel_ok

        report["experts_scaled_grouped_mm"] = _kernel_ok(device)
        ok &= report["experts_scaled_grouped_mm"]
        if "rowwise" in recipes:  # its own probe: row-wise scales, forward and wgrad
            from megamoe.model.fp8 import rowwise_grouped

            report["rowwise_experts_scaled_grouped_mm"] = rowwise_grouped.usable(
                "rowwise", device, E4M3, E4M3, torch.bfloat16, 16, 16)
            ok &= report["rowwise_experts_scaled_grouped_mm"]
    return report, bool(ok)
