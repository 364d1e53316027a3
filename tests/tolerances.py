"""Tolerances for comparisons that cannot be bitwise, each derived from its dtype's unit
roundoff and the depth of the computation.

Bitwise equality is right only when both sides run the same kernels in the same process
(a resumed run against one that never stopped, a rerun, a layout proven bitwise). A value
recorded on another machine, or two different kernels for the same math (fused against
foreach AdamW, an fp32 router inside an fp64 model), differ in the last bits: BLAS and
ATen pick their blocking and vector width per CPU (AVX2, AVX-512, ARM) and per thread
count. Those comparisons use `ulp_tol`: `n` units of roundoff of `dtype`, scaled by the
reference's magnitude, with `n` the number of roundings that can pile up (a few per op,
times the ops on the longest path). Each call site says how it chose `n`; the fixture
tests also show that a wrong load moves the result by orders of magnitude more.
"""

from __future__ import annotations

import torch


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def ulp_tol(ref: torch.Tensor, n: float, dtype: torch.dtype = torch.float32) -> dict:
    """assert_close kwargs: |got - ref| <= n * eps(dtype) * max|ref| elementwise (rtol 0).

    The scale is the tensor's largest magnitude, not each element's: a sum of terms of
    both signs carries the roundoff of its largest terms, so a small element's relative
    error can be large while its absolute error stays at the tensor's scale."""
    scale = float(ref.detach().abs().max()) if ref.numel() else 0.0
    return {"atol": n * eps(dtype) * max(scale, torch.finfo(dtype).tiny), "rtol": 0.0}
