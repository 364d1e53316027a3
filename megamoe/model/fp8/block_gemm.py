"""The GEMM of two block-quantised operands, a @ b^T with a [M, K] and b [N, K] tiled along
K (blocks.py), on the best kernel the device has, else the exact reference.

  reference  (a.data * a.scale_inv) @ (b.data * b.scale_inv)^T in fp32: the GEMM on the
             dequantised FP8 values, the same products a block-scaled kernel forms (only the
             fp32 accumulation order differs). Used on the CPU for blockwise and mxfp8, and
             wherever no kernel below passed its probe.
  rowwise    torch._scaled_mm with row-wise scales ([M, 1] and [1, N]): the CPU build has
             it; CUDA (sm89+) needs bf16 output and dimensions multiples of 16.
  blockwise  torch.nn.functional.scaled_mm with BlockWise1x128 / BlockWise128x128 scales
             (CUDA sm90, torch >= 2.9; DeepSeek-V3's GEMM). E4M3 operands only (torch's
             check_deepseek_recipe; seen refusing E5M2 on an H200, torch 2.11): under
             --fp8-format hybrid the E5M2-gradient GEMMs (dgrad, wgrad) run the reference.
  mxfp8      torch.nn.functional.scaled_mm with BlockWise1x32 E8M0 scales in cuBLAS's
             swizzled layout (CUDA sm100).

A kernel is used only after a probe: once per (kernel, tile pair, device) it runs a small
aligned GEMM and is compared with the reference; an exception or a mismatch keeps the
reference for that device (KERNEL_STATUS says which; a warning says so once). The key
holds both operands' FP8 types: the forward's E4M3 x E4M3 probe says nothing of a
backward E5M2 x E4M3 GEMM.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megamoe.model.fp8.blocks import BlockQ, quantize_operand

KERNEL_STATUS: dict[tuple, bool] = {}


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """(major, minor) of a CUDA device, None elsewhere (the dispatch's only device fact;
    tests replace it to show the choice per capability)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def reference_mm(a: BlockQ, b: BlockQ, out_dtype: torch.dtype) -> torch.Tensor:
    """The exact quantise-dequantise GEMM: dequantised operands, fp32 matmul."""
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def _aligned(*dims: int, to: int = 16) -> bool:
    return all(d % to == 0 for d in dims)


def _col_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def _rowwise_kernel(a: BlockQ, b: BlockQ, out_dtype: torch.dtype) -> torch.Tensor:
    return torch._scaled_mm(a.data.contiguous(), _col_major(b.data.t()),
                            scale_a=a.scale_inv.contiguous(),
                            scale_b=b.scale_inv.t().contiguous(), out_dtype=out_dtype)


def _blockwise_scale(q: BlockQ) -> tuple[torch.Tensor, object]:
    """torch's layouts (torch/_meta_registrations.py, _scaled_mm_v2's checks; the tests
    run them on meta tensors): a 1x128 operand [rows, K/128] with stride [1, rows] (as a
    or as b); a 128x128 b operand [round_up(K/128, 4), N/128] with stride [1, L4]."""
    s = q.scale_inv
    if q.tile[0] == 128:  # a 128x128 weight as b: [K/128 padded to 4, N/128]
        s = s.t()
        pad = -s.shape[0] % 4
        s = F.pad(s, (0, 0, 0, pad)) if pad else s
        return _col_major(s), F.ScalingType.BlockWise128x128
    return _col_major(s), F.ScalingType.BlockWise1x128


def _blockwise_kernel(a: BlockQ, b: BlockQ, out_dtype: torch.dtype) -> torch.Tensor:
    sa, ra = _blockwise_scale(a)
    sb, rb = _blockwise_scale(b)
    return F.scaled_mm(a.data.contiguous(), _col_major(b.data.t()), sa, ra, sb, rb,
                       output_dtype=out_dtype)


def swizzle_e8m0(scale_RC: torch.Tensor) -> torch.Tensor:
    """cuBLAS's block-scaling-factor layout (cuBLAS docs, "1D block scaling factors
    layout"): rows padded to 128, columns to 4; each 128x4 tile is stored as 32x16 with
    row r of the tile at (r % 32, 4 * (r // 32) + c); flattened."""
    r, c = scale_RC.shape
    nr, nc = math.ceil(r / 128), math.ceil(c / 4)
    padded = scale_RC.new_zeros(nr * 128, nc * 4)
    padded[:r, :c] = scale_RC
    blocks = padded.view(nr, 128, nc, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _mxfp8_kernel(a: BlockQ, b: BlockQ, out_dtype: torch.dtype) -> torch.Tensor:
    e8 = torch.float8_e8m0fnu
    sa = swizzle_e8m0(a.scale_inv).to(e8)  # exact: powers of 2
    sb = swizzle_e8m0(b.scale_inv).to(e8)
    sw = F.SwizzleType.SWIZZLE_32_4_4
    blk = F.ScalingType.BlockWise1x32
    return F.scaled_mm(a.data.contiguous(), _col_major(b.data.t()), sa, blk, sb, blk,
                       swizzle_a=sw, swizzle_b=sw, output_dtype=out_dtype)


def _kernel_and_multiple(recipe: str, device: torch.device, a_dtype: torch.dtype,
                         b_dtype: torch.dtype, out_dtype: torch.dtype):
    """(kernel, the multiple its dimensions must be) on this device for these operand
    types, or (None, 1): the reference. The CPU's rowwise kernel takes any dims."""
    cap = device_capability(device)
    if recipe == "rowwise":
        if cap is None:
            return _rowwise_kernel, 1
        ok = cap >= (8, 9) and out_dtype == torch.bfloat16
        return (_rowwise_kernel, 16) if ok else (None, 1)
    if recipe == "blockwise" and cap == (9, 0) and hasattr(F, "scaled_mm"):
        if a_dtype == b_dtype == torch.float8_e4m3fn:
            return _blockwise_kernel, 128
        _warn_once(("blockwise-e5m2", device),
                   "FP8 blockwise: torch's block-scaled kernel takes E4M3 operands only, so "
                   "the E5M2 gradient GEMMs of --fp8-format hybrid run the reference GEMM "
                   "(slow); --fp8-format e4m3 (DeepSeek-V3's choice) keeps them on the kernel")
        return None, 1
    if recipe == "mxfp8" and cap is not None and cap[0] == 10 \
            and hasattr(torch, "float8_e8m0fnu") and hasattr(F, "scaled_mm"):
        return _mxfp8_kernel, 128
    return None, 1


def _kernel_for(recipe: str, a: BlockQ, b: BlockQ, out_dtype: torch.dtype):
    """The kernel this device could run for this GEMM (None: the reference)."""
    (m, k), n = a.data.shape, b.data.shape[0]
    kernel, multiple = _kernel_and_multiple(recipe, a.data.device, a.data.dtype,
                                            b.data.dtype, out_dtype)
    return kernel if _aligned(m, k, n, to=multiple) else None


def kernel_multiple(recipe: str, a: BlockQ, b: BlockQ, out_dtype: torch.dtype) -> int:
    """The multiple a GEMM's dims must be to reach this device's kernel, for a caller
    that can pad them with zeros (block_pad.py); 1 where there is nothing to pad for:
    no kernel here, the CPU (its rowwise kernel takes any dims), or a failed probe."""
    if device_capability(a.data.device) is None:
        return 1
    kernel, multiple = _kernel_and_multiple(recipe, a.data.device, a.data.dtype,
                                            b.data.dtype, out_dtype)
    if kernel is None or KERNEL_STATUS.get(kernel_key(recipe, a, b)) is False:
        return 1
    return multiple


def probed(key, probe: Callable[[], bool], warning: Callable[[], str]) -> bool:
    """KERNEL_STATUS[key], running probe() the first time; a failed probe warns once
    (the kernel's callers then keep their fallback on that device). `warning` makes the
    message only then: this runs on every GEMM."""
    if key not in KERNEL_STATUS:
        KERNEL_STATUS[key] = probe()
        if not KERNEL_STATUS[key]:
            warnings.warn(warning(), stacklevel=3)
    return KERNEL_STATUS[key]


def agrees(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether a kernel's output equals the fp32 reference up to what a kernel may differ
    by: fp32 accumulation order and bf16 output (the probes' test)."""
    return bool(((got.float() - ref).abs() <= 2.0 ** -7 * ref.abs()
                 + 1e-3 * ref.abs().max()).all())


_WARNED: set = set()


def _warn_once(key, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def kernel_key(recipe: str, a: BlockQ, b: BlockQ) -> tuple:
    """KERNEL_STATUS's key: one probe per recipe, tile pair, FP8 type pair and device."""
    return (recipe, _tiling(recipe, a), _tiling(recipe, b), a.data.dtype, b.data.dtype,
            a.data.device)


def _tiling(recipe: str, q: BlockQ):
    """A row-wise tile spans the whole contraction (1 x K): one tiling whatever K is, so
    the probe runs once, not once per contraction length (an expert's row count)."""
    return "row" if recipe == "rowwise" else q.tile


def _probe(kernel, recipe: str, a: BlockQ, b: BlockQ) -> bool:
    """Run the kernel once on a small aligned GEMM with a's and b's dtypes and tilings and
    compare it with the reference (fp32 accumulation order and bf16 output only): any
    error or mismatch means no."""
    dev = a.data.device
    # host draws (the same values on every device), once per kernel, then moved
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(128, 256, generator=gen, device="cpu").to(dev)  # (host draw, above)
    w = torch.randn(256, 256, generator=gen, device="cpu").to(dev)  # (host draw, above)
    qa = quantize_operand(x, recipe, a.data.dtype, weight=a.tile[0] == 128)
    qb = quantize_operand(w, recipe, b.data.dtype, weight=b.tile[0] == 128)
    try:
        got = kernel(qa, qb, torch.bfloat16).float()
    except Exception:  # noqa: BLE001 - any failure (layout, build, device) means "no"
        return False
    return agrees(got, reference_mm(qa, qb, torch.float32))


def block_mm(a: BlockQ, b: BlockQ, out_dtype: torch.dtype, recipe: str) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] in out_dtype, both tiled along K: the device's
    block-scaled kernel when it has one and it passed its probe, else the reference."""
    kernel = _kernel_for(recipe, a, b, out_dtype)
    if kernel is not None and device_capability(a.data.device) is not None:
        if not probed(kernel_key(recipe, a, b), lambda: _probe(kernel, recipe, a, b),
                      lambda: f"FP8 {recipe}: the {a.tile}x{b.tile} kernel failed its probe "
                              f"on {a.data.device}; the reference GEMM runs there"):
            kernel = None
    if kernel is None:
        return reference_mm(a, b, out_dtype)
    return kernel(a, b, out_dtype)
