"""The rowwise recipe's expert GEMMs as one torch._scaled_grouped_mm each (CUDA sm90).

torch._scaled_grouped_mm is a row-wise scaled kernel: a scale per row of a and per column
of b, exactly the rowwise recipe's tiling (one scale per row of each operand along the
contraction), so the per-expert loop's products are formed at once:

  forward  x [N, K] @ W_e [K, M]: a scale per row of x, per (expert, column) of W (2-D x 3-D)
  dgrad    g [N, M] @ W_e^T [M, K]: per row of g, per (expert, column) of W^T (2-D x 3-D)
  wgrad    x_e^T [K, n_e] @ g_e [n_e, M]: per (expert, row of x^T), per (expert, column of
           g), both tiled along the expert's rows (2-D x 2-D, groups along the contraction)

Only E4M3 x E4M3 with bf16 output (the kernel's types), K and M multiples of 16, after a
probe against the dequantised loop passed once per device (KERNEL_STATUS); hybrid's E5M2
gradients run the per-expert loop. torch's kernel asserts on the device that the 2-D x 2-D
groups are multiples of 16 (aten/src/ATen/native/cuda/GroupMMCommon.cuh), so wgrad pads
each expert's rows with zeros to that, at least 16 (zeros add nothing; pad_block; no
K = 0 GEMM for an empty expert).
"""

from __future__ import annotations

import torch

from megamoe.model.fp8.block_gemm import agrees, device_capability, probed
from megamoe.model.fp8.block_pad import pad_block, round_up
from megamoe.model.fp8.blocks import BlockQ, quantize_operand
from megamoe.model.fp8.quantize import E4M3

GROUP_MULTIPLE = 16  # the kernel's 2-D x 2-D group alignment (16 bytes of FP8)


def _scaled_grouped_mm(*args, **kwargs):
    """torch's grouped FP8 GEMM (a name tests can replace with a CPU stand-in)."""
    return torch._scaled_grouped_mm(*args, **kwargs)


def usable(recipe: str, device: torch.device, a_dtype, b_dtype, out_dtype, *dims: int) -> bool:
    """Whether this rowwise expert GEMM runs on the grouped kernel here."""
    if recipe != "rowwise" or device_capability(device) != (9, 0) \
            or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if not (a_dtype == b_dtype == E4M3 and out_dtype == torch.bfloat16
            and all(d % 16 == 0 for d in dims)):
        return False
    return probed(("scaled_grouped_mm_rowwise", device), lambda: _probe(device),
                  lambda: f"FP8 rowwise experts: torch._scaled_grouped_mm failed its probe "
                          f"on {device}; the per-expert loop runs there")


def padded_group_sizes(sizes: list[int]) -> list[int]:
    """Each 2-D x 2-D group's row count padded to the kernel's multiple, at least one
    multiple (module doc: no K = 0 GEMM for an empty expert)."""
    return [max(GROUP_MULTIPLE, round_up(n, GROUP_MULTIPLE)) for n in sizes]


def group_offsets(sizes: list[int], device: torch.device) -> torch.Tensor:
    """Cumulative group ends (int32), as torch's grouped GEMMs take them."""
    ends, total = [], 0
    for n in sizes:
        total += n
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _stacked_t(qs: list[BlockQ]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert b operands [M, K] (tiled along K) as the kernel's [E, K, M], column-major
    per expert, and their scales [E, M]."""
    data = torch.stack([q.data for q in qs]).transpose(1, 2)
    return data, torch.stack([q.scale_inv.reshape(-1) for q in qs])


def rows_mm(qa: BlockQ, qbs: list[BlockQ], sizes: list[int], out_dtype) -> torch.Tensor:
    """Forward and dgrad: qa [N, K] (row-wise along K; expert e's rows consecutive) @
    expert e's qbs[e] [M, K]^T -> [N, M]."""
    b, scale_b = _stacked_t(qbs)
    return _scaled_grouped_mm(qa.data.contiguous(), b, qa.scale_inv.reshape(-1).contiguous(),
                              scale_b, offs=group_offsets(sizes, qa.data.device),
                              out_dtype=out_dtype)


def wgrad_mm(qx_ts: list[BlockQ], qg_ts: list[BlockQ], recipe: str, out_dtype) -> torch.Tensor:
    """dW_e = x_e^T g_e for every expert: qx_ts[e] [K, n_e], qg_ts[e] [M, n_e], each tiled
    along n_e, padded to a positive multiple of 16 columns -> [E, K, M]."""
    padded = padded_group_sizes([q.data.shape[1] for q in qx_ts])
    xs = [pad_block(q, q.data.shape[0], n, recipe) for q, n in zip(qx_ts, padded)]
    gs = [pad_block(q, q.data.shape[0], n, recipe) for q, n in zip(qg_ts, padded)]
    a = torch.cat([q.data for q in xs], dim=1)  # [K, sum n]: row-major
    b = torch.cat([q.data for q in gs], dim=1).t()  # [sum n, M]: column-major
    scale_a = torch.cat([q.scale_inv.reshape(-1) for q in xs])  # [E * K]: e * K + k
    scale_b = torch.cat([q.scale_inv.reshape(-1) for q in gs])  # [E * M]
    return _scaled_grouped_mm(a, b, scale_a, scale_b, offs=group_offsets(padded, a.device),
                              out_dtype=out_dtype)


def _probe(device: torch.device) -> bool:
    """The forward (groups of 16, 0 and 32 rows) and wgrad (groups of 16, 16 and 32) of
    three experts, K = M = 32, with a different power-of-2 scale per row and column, on
    the kernel against the dequantised per-expert GEMMs; any error or a difference beyond
    bf16 rounding means no."""
    # host draws (the same values on every device), once per device, then moved
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(48, 32, generator=gen, device="cpu").to(device)  # (host draw, above)
    w = torch.randn(3, 32, 32, generator=gen, device="cpu").to(device)  # (host draw, above)
    x = x * torch.exp2(torch.arange(48, device=device) % 7 - 3.0)[:, None]
    sizes, bounds = [16, 0, 32], [(0, 16), (16, 16), (16, 48)]
    qx = quantize_operand(x, "rowwise", E4M3)
    qws = [quantize_operand(w[e].t(), "rowwise", E4M3) for e in range(3)]
    qx_ts = [quantize_operand(x[lo:hi].t(), "rowwise", E4M3) for lo, hi in bounds]
    try:
        y = rows_mm(qx, qws, sizes, torch.bfloat16).float()
        dw = wgrad_mm(qx_ts, qx_ts, "rowwise", torch.bfloat16).float()
    except Exception:  # noqa: BLE001 - any failure (build, layout, device) means "no"
        return False
    deq = qx.dequantize()
    ref_y = torch.cat([deq[lo:hi] @ qws[e].dequantize().t() for e, (lo, hi) in enumerate(bounds)])
    ref_dw = torch.stack([q.dequantize() @ q.dequantize().t() for q in qx_ts])
    return agrees(y, ref_y) and agrees(dw, ref_dw)
