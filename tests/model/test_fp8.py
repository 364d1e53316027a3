"""FP8 math (megamoe/model/fp8/): known-answer vectors for TE's formulas, and the FP8
GEMMs against (a) the same GEMM on independently quantised operands (tight: only fp32
accumulation order differs) and (b) the fp32 GEMM within the bound the format implies.

The format bound. Round-to-nearest into a format with m mantissa bits has relative error
u = 2^-(m+1) (E4M3: 2^-4, E5M2: 2^-3) for normal values, and absolute error at most half the
smallest subnormal (E4M3: 2^-10, E5M2: 2^-17) below; in the tensor's own units
|x' - x| <= E = u|x| + d/scale, elementwise. Then for C = A B:
|A'B' - AB| <= E_A|B| + |A|E_B + E_A E_B  (elementwise, with |.| taken elementwise),
plus fp32 accumulation: K 2^-24 (|A|+E_A)(|B|+E_B).
"""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.config.fp8 import Fp8Config
from megamoe.model.fp8.grouped import fp8_grouped_mm
from megamoe.model.fp8.linear import fp8_linear
from megamoe.model.fp8.policy import Fp8State
from megamoe.model.fp8.quantize import (
    E4M3,
    E5M2,
    current_scale,
    delayed_scale,
    format_dtypes,
    quantize,
)
from megamoe.model.fp8.scaling import Fp8Meta

U = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
HALF_SUBNORMAL = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}
MAXES = {E4M3: 448.0, E5M2: 57344.0}
CPU = torch.device("cpu")


def test_scale_formula_known_answers():
    amax = torch.tensor([2.0, 0.0, math.inf, math.nan, 1e-45, 448.0])
    prev = torch.full((6,), 3.0)
    # TE's _default_sf_compute: (fp8_max / amax) / 2^margin, previous scale for 0/inf/nan,
    # fp32 max for an infinite quotient
    f32max = torch.finfo(torch.float32).max
    assert delayed_scale(amax, prev, 448.0, 0).tolist() == [224.0, 3.0, 3.0, 3.0, f32max, 1.0]
    assert delayed_scale(amax, prev, 448.0, 2).tolist() == [56.0, 3.0, 3.0, 3.0, f32max, 0.25]
    assert delayed_scale(amax[:1], prev[:1], 57344.0, 1).tolist() == [14336.0]
    # TE's compute_scale_from_amax (current scaling): 1 for 0 / non-finite
    assert current_scale(amax, 448.0).tolist() == [224.0, 1.0, 1.0, 1.0, f32max, 1.0]


@pytest.mark.parametrize("algo,margin,expected", [
    ("most_recent", 0, [224.0, 112.0, 448.0, 896.0, 896.0, 896.0]),
    ("max", 0, [224.0, 112.0, 112.0, 112.0, 448.0, 448.0]),
    ("max", 1, [112.0, 56.0, 56.0, 56.0, 224.0, 224.0]),
])
def test_amax_history_update_known_answers(algo, margin, expected):
    """History of 3 steps; step amaxes 2, 4, 1, 0.5, 0.5, 0 (0: no data, the scale stays).
    max: the window is the last 3 steps (step 5: max(1, 0.5, 0.5) = 1 -> 448)."""
    meta = Fp8Meta("delayed", E4M3, 1, history_len=3, compute_algo=algo, margin=margin)
    scales = []
    for a in (2.0, 4.0, 1.0, 0.5, 0.5, 0.0):
        used = meta.scale_for(torch.tensor([a]))
        meta.update()
        scales.append(meta.scale.item())
    assert used.item() == expected[-2]  # the scale used is the one before the update
    if algo == "most_recent":
        assert scales == expected
    else:
        assert scales[:5] == expected[:5]
        # step 6 records 0: the window (0.5, 0.5, 0) has max 0.5 -> 896 / 2^margin
        assert scales[5] == 896.0 / 2 ** margin


def test_saturation_and_rounding_known_answers():
    x = torch.tensor([1000.0, -1e6, 448.1, 0.5, 0.3, float("nan"), 1e-4])
    one = torch.tensor(1.0)
    q4 = quantize(x, one, E4M3).float()
    assert q4[:5].tolist() == [448.0, -448.0, 448.0, 0.5, 0.3125]
    assert math.isnan(q4[5]) and q4[6].item() == 0.0  # 1e-4 < half of E4M3's 2^-9
    q5 = quantize(x, one, E5M2).float()
    assert q5[:5].tolist() == [1024.0, -57344.0, 448.0, 0.5, 0.3125]
    assert quantize(torch.tensor([1e5]), one, E5M2).float().item() == 57344.0
    assert format_dtypes("hybrid") == (E4M3, E5M2) and format_dtypes("e4m3") == (E4M3, E4M3)


def test_rowwise_scaled_mm_runs_on_this_cpu():
    """torch._scaled_mm takes row-wise scales here too (issue 32: the row-wise recipe can
    be built on it): equal to the dequantised product."""
    a = torch.randn(8, 32).to(E4M3)
    b = torch.randn(16, 32).to(E4M3)
    sa, sb = torch.rand(8, 1) + 0.5, torch.rand(1, 16) + 0.5
    y = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    torch.testing.assert_close(y, (a.float() * sa) @ (b.float().t() * sb),
                               rtol=1e-5, atol=1e-5)  # fp32 accumulation order only


def _q(x: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent tensor-wise quantise-dequantise: (x', bound E of |x' - x|)."""
    s = MAXES[dtype] / x.abs().max()
    xq = (x * s).clamp(-MAXES[dtype], MAXES[dtype]).to(dtype).float() / s
    return xq, U[dtype] * x.abs() + HALF_SUBNORMAL[dtype] / s


def _check_gemm(got, a, b, ea, eb, a_q, b_q):
    k = a.shape[1]
    tight = a_q @ b_q
    torch.testing.assert_close(got, tight, rtol=1e-5, atol=1e-6)  # accumulation order
    bound = ea @ b.abs() + a.abs() @ eb + ea @ eb \
        + k * 2.0 ** -24 * (a.abs() + ea) @ (b.abs() + eb)
    err = (got - a @ b).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    return float(err.norm() / (a @ b).norm())


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_linear_forward_and_gradients_within_the_format_bound(fmt):
    torch.manual_seed(0)
    fwd, bwd = format_dtypes(fmt)
    state = Fp8State(Fp8Config(format=fmt, recipe="tensorwise"))
    scaling = state.new_scaling("lin", 1, CPU)
    x = torch.randn(48, 64, dtype=torch.float64).float().requires_grad_()
    w = (0.05 * torch.randn(32, 64)).requires_grad_()
    y = fp8_linear(x, w, None, scaling)
    g = torch.randn_like(y)
    y.backward(g)
    xq, ex = _q(x.detach(), fwd)
    wq, ew = _q(w.detach(), fwd)
    gq, eg = _q(g, bwd)
    rel = [_check_gemm(y.detach(), x.detach(), w.detach().t(), ex, ew.t(), xq, wq.t()),
           _check_gemm(x.grad, g, w.detach(), eg, ew, gq, wq),
           _check_gemm(w.grad, g.t(), x.detach(), eg.t(), ex, gq.t(), xq)]
    assert max(rel) < 2 * U[bwd]  # the norm-wise error is well inside the worst case


def test_fp8_grouped_gemm_matches_per_expert_reference():
    """The experts' GEMM: one scale per expert and operand, an empty expert included."""
    torch.manual_seed(1)
    state = Fp8State(Fp8Config(format="hybrid", recipe="tensorwise"))
    scaling = state.new_scaling("experts", 3, CPU)
    sizes = [7, 0, 13]
    x = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    y = fp8_grouped_mm(x, w, sizes, scaling)
    g = torch.randn_like(y)
    y.backward(g)
    for e, (lo, hi) in enumerate([(0, 7), (7, 7), (7, 20)]):
        if lo == hi:
            assert bool((w.grad[e] == 0).all())
            continue
        xe, ge, we = x.detach()[lo:hi], g[lo:hi], w.detach()[e]
        xq, ex = _q(xe, E4M3)
        wq, ew = _q(we, E4M3)
        gq, eg = _q(ge, E5M2)
        _check_gemm(y.detach()[lo:hi], xe, we, ex, ew, xq, wq)
        _check_gemm(x.grad[lo:hi], ge, we.t(), eg, ew.t(), gq, wq.t())
        _check_gemm(w.grad[e], xe.t(), ge, ex.t(), eg, xq.t(), gq)


def test_delayed_scaling_uses_the_previous_steps_amax():
    """Step 1 quantises with scale 1 (TE's initial state); after the update the scale is
    fp8_max / amax of step 1's tensor."""
    state = Fp8State(Fp8Config(format="e4m3", recipe="delayed"))
    scaling = state.new_scaling("lin", 1, CPU)
    x = torch.full((16, 16), 0.001)
    w = torch.eye(16) * 3.0
    y1 = fp8_linear(x, w, None, scaling)
    assert scaling.x.amax_history[0].item() == pytest.approx(0.001)
    state.update()
    assert scaling.x.scale.item() == pytest.approx(448.0 / 0.001)
    assert scaling.w.scale.item() == pytest.approx(448.0 / 3.0)
    y2 = fp8_linear(x, w, None, scaling)
    # 0.001 * 1 falls into E4M3's subnormals (coarse); scaled by 448e3 it is exact-ish
    assert abs(y1[0, 0].item() - 0.003) > abs(y2[0, 0].item() - 0.003)
    assert y2[0, 0].item() == pytest.approx(0.003, rel=U[E4M3])


def test_delayed_state_round_trip_and_checks():
    state = Fp8State(Fp8Config(format="hybrid", recipe="delayed", amax_history_len=2))
    s = state.new_scaling("a", 2, CPU)
    s.x.scale_for(torch.tensor([1.0, 2.0]))
    state.update()
    saved = state.state_dict()
    other = Fp8State(Fp8Config(format="hybrid", recipe="delayed", amax_history_len=2))
    other.new_scaling("a", 2, CPU)
    other.load_state_dict(saved)
    assert torch.equal(other.scalings["a"].x.scale, s.x.scale)
    bad = {k: dict(v) for k, v in saved.items()}
    bad["a.x"]["scale"] = torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match=r"a\.x\]\.scale: values must be finite and positive"):
        other.load_state_dict(bad)
    with pytest.raises(ValueError, match="differ from this model"):
        other.load_state_dict({"b.x": saved["a.x"]})


def test_fp8_gemms_stay_on_the_device_without_host_reads():
    """Under FakeTensorMode on the stand-in accelerator ("meta", tests/test_fake_device.py):
    a host tensor mixed in raises FakeTensorDeviceMismatchError and a value read (.item())
    raises; the FP8 linear, the grouped GEMM and the delayed update run through, under
    every recipe built."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = torch.device("meta")
    with FakeTensorMode():
        for recipe in ("tensorwise", "delayed", "blockwise", "mxfp8", "rowwise"):
            state = Fp8State(Fp8Config(format="hybrid", recipe=recipe))
            lin, experts = state.new_scaling("l", 1, dev), state.new_scaling("e", 2, dev)
            x = torch.randn(32, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(48, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
            w_e = torch.randn(2, 64, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
            y = fp8_linear(x, w, None, lin)
            (y.sum() + fp8_grouped_mm(x, w_e, [20, 12], experts).sum()).backward()
            state.update()
            assert y.dtype == torch.bfloat16 and x.grad.device == dev
            assert w_e.grad.device == dev
