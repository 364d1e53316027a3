"""The block-scaled FP8 recipes (megamoe/model/fp8/blocks.py, block_linear.py,
block_gemm.py): known answers from the cited formulas (Transformer Engine's power-of-2
block scales, its E8M0 rounding, saturation), a naive per-tile quantiser written here from
the same formulas with Python floats, and the FP8 GEMMs (forward, dgrad, wgrad; dense and
per-expert) against (a) the GEMM of operands quantised by that naive quantiser (tight:
fp32 accumulation order only) and (b) the fp32 GEMM within the format's elementwise bound
|A'B' - AB| <= E_A|B| + |A|E_B + E_A E_B, with E = u|x| + d * scale_inv(tile)
(u = 2^-4 for E4M3, 2^-3 for E5M2; d half the smallest subnormal), as tests/model/test_fp8.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megamoe.config.fp8 import Fp8Config
from megamoe.model.fp8 import block_gemm, grouped
from megamoe.model.fp8.block_gemm import swizzle_e8m0
from megamoe.model.fp8.blocks import (
    BlockQ,
    e8m0_exponent,
    pow2_scale,
    quantize_operand,
    quantize_tiles,
)
from megamoe.model.fp8.grouped import fp8_grouped_mm
from megamoe.model.fp8.linear import fp8_linear
from megamoe.model.fp8.policy import Fp8State
from megamoe.model.fp8.quantize import E4M3, format_dtypes
from tests.model.test_fp8 import HALF_SUBNORMAL, U  # the formats' rounding bounds
from tests.model.test_fp8 import MAXES as MAX

CPU = torch.device("cpu")
RECIPES = ("blockwise", "mxfp8", "rowwise")


def test_power_of_2_block_scale_known_answers():
    """TE's compute_scale_from_amax(force_pow_2_scales): 448 / amax with the mantissa
    cleared; 0, inf, NaN -> 1; an fp32 overflow -> fp32 max -> 2^127."""
    amax = torch.tensor([1.0, 448.0, 500.0, 3.0, 0.0, math.inf, math.nan, 1e-45, 0.001])
    assert pow2_scale(amax, 448.0).tolist() == [256.0, 1.0, 0.5, 128.0, 1.0, 1.0, 1.0,
                                                2.0 ** 127, 2.0 ** 18]
    assert pow2_scale(torch.tensor([1.0]), 57344.0).tolist() == [32768.0]


def test_e8m0_rounding_known_answers():
    """TE's float_to_e8m0(amax * fp32(1/448)), round up: 448 is exactly 2^0 (no round-up),
    449 rounds to 2^1, 1 -> 2^-8 (1/448 = 2^-8.81); 0 -> biased 0; inf -> 0xFE; NaN -> 0xFF.
    Where TE and the OCP MX spec v1.0 differ: amax 500 gives TE 2^1 (no value saturates)
    but OCP X = 2^(floor(log2 500) - 8) = 2^0, which saturates 500 to 448."""
    amax = torch.tensor([448.0, 449.0, 1.0, 500.0, 0.0, math.inf, math.nan, 57344.0])
    biased = e8m0_exponent(amax, 448.0)
    assert (biased - 127).tolist()[:4] == [0, 1, -8, 1]
    assert biased.tolist()[4:7] == [0, 0xFE, 0xFF]
    assert (biased[7] - 127).item() == 7  # 57344 / 448 = 128 exactly
    assert (e8m0_exponent(torch.tensor([57344.0]), 57344.0) - 127).tolist() == [0]
    ocp = math.floor(math.log2(500.0)) - 8
    assert ocp == 0 and (biased[3] - 127).item() == ocp + 1


def test_block_quantisation_known_answers():
    """A 2 x 160 tensor (a full 1x128 tile and a partial one of 32; a row of zeros):
    blockwise scale 448/3 -> 128 (3 and 1 exact), 0.001 -> scale 2^18, 262.144 -> 256 in
    E4M3; MXFP8 tiles of 32: 2^-7 where the 3 is, 2^-8 for ones, 2^-18 for 0.001; a zero
    tile keeps scale 1; inf saturates to 448 (scale 1, TE's amax rule)."""
    x = torch.zeros(2, 160)
    x[0, :128] = 1.0
    x[0, 5] = 3.0
    x[0, 128:] = 0.001
    q = quantize_operand(x, "blockwise", E4M3)
    assert q.scale_inv.tolist() == [[1 / 128, 2.0 ** -18], [1.0, 1.0]]
    assert q.data.float()[0, [0, 5, 130]].tolist() == [128.0, 384.0, 256.0]
    assert q.dequantize()[0, 130].item() == 256 * 2.0 ** -18
    m = quantize_operand(x, "mxfp8", E4M3)
    assert (m.scale_inv[0].log2()).tolist() == [-7, -8, -8, -8, -18]
    assert m.scale_inv[1].tolist() == [2.0 ** -127] * 5  # biased 0; data 0
    assert m.data.float()[0, [5, 40, 150]].tolist() == [384.0, 256.0, 256.0]
    w = torch.ones(256, 130)
    w[200, 3] = 10.0  # block (1, 0): scale 448/10 -> 32
    qw = quantize_operand(w, "blockwise", E4M3, weight=True)
    assert qw.tile == (128, 128) and qw.scale_inv.tolist() == [[1 / 256, 1 / 256],
                                                               [1 / 32, 1 / 256]]
    sat = quantize_tiles(torch.tensor([[math.inf, 1.0, 1000.0]]), (1, 128), E4M3, "blockwise")
    assert sat.data.float().tolist() == [[448.0, 1.0, 448.0]]
    r = quantize_operand(torch.tensor([[1.0, -2.0], [0.0, 0.0]]), "rowwise", E4M3)
    assert r.scale_inv.tolist() == [[1 / 128], [1.0]]  # 448/2 -> 128


def _naive_scale_inv(amax: float, recipe: str, fp8_max: float) -> float:
    """The tile's scale_inv from the cited formulas with Python floats (no bit tricks)."""
    if recipe == "mxfp8":
        if amax == 0:
            return 2.0 ** -127
        v = float(np.float32(amax) * np.float32(1.0 / fp8_max))
        m, e = math.frexp(v)  # v = m 2^e, m in [0.5, 1)
        return 2.0 ** (e - 1 if m == 0.5 else e)
    if amax == 0:
        return 1.0
    m, e = math.frexp(fp8_max / amax)
    return 1.0 / 2.0 ** (e - 1)


def _naive(x: torch.Tensor, recipe: str, dtype, weight: bool = False):
    """Tile by tile (loops): (x', bound E of |x' - x|) for one GEMM operand [rows, K]."""
    r, k = x.shape
    tr, tk = (128, 128) if recipe == "blockwise" and weight else \
        (1, {"blockwise": 128, "mxfp8": 32, "rowwise": k}[recipe])
    xq, err = torch.empty(r, k), torch.empty(r, k)
    for i in range(0, r, tr):
        for j in range(0, k, tk):
            t = x[i:i + tr, j:j + tk].float()
            s = _naive_scale_inv(float(t.abs().max()), recipe, MAX[dtype])
            xq[i:i + tr, j:j + tk] = (t / s).clamp(-MAX[dtype], MAX[dtype]).to(dtype).float() * s
            err[i:i + tr, j:j + tk] = U[dtype] * t.abs() + HALF_SUBNORMAL[dtype] * s
    return xq, err


def _check(got, a, b_t, a_q, ea, b_q, eb):
    """got ~ a @ b_t^T: tight against the quantised operands, bounded against fp32."""
    b, bq, e_b = b_t.t(), b_q.t(), eb.t()
    torch.testing.assert_close(got.float(), a_q @ bq, rtol=1e-5, atol=1e-5)
    k = a.shape[1]
    bound = ea @ b.abs() + a.abs() @ e_b + ea @ e_b \
        + k * 2.0 ** -24 * (a.abs() + ea) @ (b.abs() + e_b)
    assert bool(((got.float() - a @ b).abs() <= bound).all())


@pytest.mark.parametrize("recipe", RECIPES)
def test_block_fp8_linear_forward_and_gradients(recipe):
    """K = 200 and T = 72: partial tiles in both contraction dimensions; hybrid format."""
    torch.manual_seed(0)
    fwd, bwd = format_dtypes("hybrid")
    scaling = Fp8State(Fp8Config(format="hybrid", recipe=recipe)).new_scaling("l", 1, CPU)
    x = (torch.randn(72, 200) * torch.logspace(-2, 1, 200)).requires_grad_()
    w = (0.05 * torch.randn(136, 200)).requires_grad_()
    y = fp8_linear(x, w, None, scaling)
    g = torch.randn_like(y)
    y.backward(g)
    xd, wd = x.detach(), w.detach()
    _check(y, xd, wd, *_naive(xd, recipe, fwd), *_naive(wd, recipe, fwd, weight=True))
    wt_q, wt_e = _naive(wd.t(), recipe, fwd, weight=True)
    _check(x.grad, g, wd.t(), *_naive(g, recipe, bwd), wt_q, wt_e)
    _check(w.grad, g.t(), xd.t(), *_naive(g.t(), recipe, bwd), *_naive(xd.t(), recipe, fwd))


@pytest.mark.parametrize("recipe", RECIPES)
def test_block_fp8_grouped_gemm_per_expert(recipe):
    """Each expert's rows tiled on their own (an empty expert included)."""
    torch.manual_seed(1)
    fwd, bwd = format_dtypes("e4m3")
    scaling = Fp8State(Fp8Config(format="e4m3", recipe=recipe)).new_scaling("e", 3, CPU)
    sizes = [40, 0, 33]
    x = torch.randn(73, 160, requires_grad=True)
    w = torch.randn(3, 160, 48, requires_grad=True)
    y = fp8_grouped_mm(x, w, sizes, scaling)
    g = torch.randn_like(y)
    y.backward(g)
    assert bool((w.grad[1] == 0).all())
    for e, (lo, hi) in enumerate([(0, 40), (40, 40), (40, 73)]):
        if lo == hi:
            continue
        xe, ge, we = x.detach()[lo:hi], g[lo:hi], w.detach()[e]
        _check(y[lo:hi], xe, we.t(), *_naive(xe, recipe, fwd),
               *_naive(we.t(), recipe, fwd, weight=True))
        _check(x.grad[lo:hi], ge, we, *_naive(ge, recipe, bwd),
               *_naive(we, recipe, fwd, weight=True))
        _check(w.grad[e], xe.t(), ge.t(), *_naive(xe.t(), recipe, fwd),
               *_naive(ge.t(), recipe, bwd))


@pytest.mark.parametrize("cap,recipe,kernel", [
    ((9, 0), "blockwise", "_blockwise_kernel"), ((10, 0), "mxfp8", "_mxfp8_kernel"),
    ((8, 9), "blockwise", None), ((9, 0), "mxfp8", None), ((10, 0), "blockwise", None),
    (None, "rowwise", "_rowwise_kernel")])
def test_block_gemm_dispatch_by_capability(monkeypatch, cap, recipe, kernel):
    """The kernel is picked by the device's capability (probe included) and called with
    layouts torch's checks accept; everything else runs the reference."""
    monkeypatch.setattr(block_gemm, "device_capability", lambda _d: cap)
    monkeypatch.setattr(block_gemm, "KERNEL_STATUS", {})
    used = []
    for name in ("_blockwise_kernel", "_mxfp8_kernel", "_rowwise_kernel"):
        real = getattr(block_gemm, name)

        def fake(a, b, out_dtype, real=real, name=name):
            meta = BlockQ(a.data.to("meta"), a.scale_inv.to("meta"), a.tile)
            meta_b = BlockQ(b.data.to("meta"), b.scale_inv.to("meta"), b.tile)
            assert real(meta, meta_b, out_dtype).shape == (a.data.shape[0], b.data.shape[0])
            used.append(name)
            return block_gemm.reference_mm(a, b, out_dtype)
        monkeypatch.setattr(block_gemm, name, fake)
    a = quantize_operand(torch.randn(256, 384), recipe, E4M3)
    b = quantize_operand(torch.randn(128, 384), recipe, E4M3, weight=True)
    y = block_gemm.block_mm(a, b, torch.bfloat16, recipe)
    torch.testing.assert_close(y, block_gemm.reference_mm(a, b, torch.bfloat16))
    assert set(used) == ({kernel} if kernel else set())


def test_swizzle_e8m0_is_cublas_layout():
    """cuBLAS's 128x4 scale tile: row r, column c at 16 * (r % 32) + 4 * (r // 32) + c."""
    s = torch.arange(128 * 4, dtype=torch.float32).reshape(128, 4)
    out = swizzle_e8m0(s)
    for r, c in [(0, 0), (1, 0), (31, 3), (32, 0), (97, 2), (127, 3)]:
        assert out[16 * (r % 32) + 4 * (r // 32) + c].item() == s[r, c].item()
    assert swizzle_e8m0(torch.ones(3, 5)).numel() == 128 * 8  # padded to 128 x 8


@pytest.mark.parametrize("cap,fmt,kernel", [((9, 0), "e4m3", True), ((9, 0), "hybrid", True),
                                            ((8, 9), "e4m3", False), ((10, 0), "e4m3", False),
                                            (None, "e4m3", False)])
def test_experts_dispatch_to_scaled_grouped_mm_by_capability(monkeypatch, cap, fmt, kernel):
    """tensorwise experts on sm90: torch._scaled_grouped_mm for the E4M3 x E4M3 GEMMs
    (hybrid's E5M2 gradients stay in the loop), with layouts torch's checks accept and the
    same result as the loop (fp32 accumulation order, bf16 output); elsewhere the loop."""
    calls = []

    def stand_in(a, b, scale_a, scale_b, offs=None, out_dtype=None):
        torch._scaled_grouped_mm(a.to("meta"), b.to("meta"), scale_a.to("meta"),
                                 scale_b.to("meta"), offs=offs.to("meta"),
                                 out_dtype=out_dtype)
        calls.append(a.dim() + b.dim())
        ends = [0] + offs.tolist()
        if b.dim() == 3:  # 2-D x 3-D: row groups
            return torch.cat([(a[lo:hi].float() * scale_a[lo:hi, None])
                              @ (b[e].float() * scale_b[e]) for e, (lo, hi)
                              in enumerate(zip(ends, ends[1:]))]).to(out_dtype)
        K, M = a.shape[0], b.shape[1]  # 2-D x 2-D: groups along the contraction
        # the CUDA kernel's device asserts (GroupMMCommon.cuh): non-empty multiples of 16
        assert all(hi - lo > 0 and (hi - lo) % 16 == 0 for lo, hi in zip(ends, ends[1:]))
        return torch.stack([(a[:, lo:hi].float() * scale_a[e * K:(e + 1) * K, None])
                            @ (b[lo:hi].float() * scale_b[e * M:(e + 1) * M])
                            for e, (lo, hi) in enumerate(zip(ends, ends[1:]))]).to(out_dtype)

    monkeypatch.setattr(grouped, "device_capability", lambda _d: cap)
    monkeypatch.setattr(block_gemm, "KERNEL_STATUS", {})
    monkeypatch.setattr(grouped, "_scaled_grouped_mm", stand_in)
    torch.manual_seed(2)
    sizes = [16, 0, 48]
    x0 = torch.randn(64, 32, dtype=torch.bfloat16)
    w0 = torch.randn(3, 32, 48, dtype=torch.bfloat16)
    res = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(grouped, "device_capability", lambda _d: None)
        scaling = Fp8State(Fp8Config(format=fmt, recipe="tensorwise")).new_scaling("e", 3, CPU)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fp8_grouped_mm(x, w, sizes, scaling)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).bfloat16())
        res.append((y, x.grad, w.grad))
    want = ([5, 5, 4] if fmt == "e4m3" else [5]) if kernel else []
    assert calls[1:] == want and (calls[:1] == [5]) == kernel  # the probe, then the GEMMs
    for a, b in zip(*res):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-3)


def test_a_kernel_that_fails_its_probe_leaves_the_reference(monkeypatch):
    """sm90 with a blockwise kernel that raises (a torch build without it): one warning,
    then the reference for every later GEMM on that device, without retrying."""
    tries = []

    def broken(a, b, out_dtype):
        tries.append(1)
        raise RuntimeError("no kernel")
    monkeypatch.setattr(block_gemm, "device_capability", lambda _d: (9, 0))
    monkeypatch.setattr(block_gemm, "KERNEL_STATUS", {})
    monkeypatch.setattr(block_gemm, "_blockwise_kernel", broken)
    a = quantize_operand(torch.randn(128, 256), "blockwise", E4M3)
    b = quantize_operand(torch.randn(128, 256), "blockwise", E4M3, weight=True)
    with pytest.warns(UserWarning, match="failed its probe"):
        y = block_gemm.block_mm(a, b, torch.float32, "blockwise")
    y2 = block_gemm.block_mm(a, b, torch.float32, "blockwise")
    assert torch.equal(y, block_gemm.reference_mm(a, b, torch.float32)) and torch.equal(y, y2)
    assert tries == [1]


def test_blockwise_e5m2_operand_runs_the_reference(monkeypatch):
    """torch's block-scaled kernel takes E4M3 x E4M3 only (an H200 with torch 2.11 refused
    hybrid's E5M2 dgrad after the forward's E4M3 probe had passed): an E5M2 operand on
    sm90 goes to the reference, with one warning, and never reaches the kernel."""
    monkeypatch.setattr(block_gemm, "device_capability", lambda _d: (9, 0))
    monkeypatch.setattr(block_gemm, "KERNEL_STATUS", {})
    monkeypatch.setattr(block_gemm, "_WARNED", set())
    called = []
    monkeypatch.setattr(block_gemm, "_blockwise_kernel",
                        lambda a, b, o: called.append(a.data.dtype) or block_gemm.reference_mm(
                            a, b, o))
    w = quantize_operand(torch.randn(128, 256), "blockwise", E4M3, weight=True)
    x = quantize_operand(torch.randn(128, 256), "blockwise", E4M3)
    g = quantize_operand(torch.randn(128, 256), "blockwise", torch.float8_e5m2)
    block_gemm.block_mm(x, w, torch.bfloat16, "blockwise")  # probe + kernel: E4M3
    with pytest.warns(UserWarning, match="E4M3 operands only"):
        y = block_gemm.block_mm(g, w, torch.bfloat16, "blockwise")
    block_gemm.block_mm(g, w, torch.bfloat16, "blockwise")  # no second warning
    assert called == [E4M3, E4M3]
    torch.testing.assert_close(y, block_gemm.reference_mm(g, w, torch.bfloat16))
    assert block_gemm.kernel_key("blockwise", x, w) != block_gemm.kernel_key("blockwise", g, w)
