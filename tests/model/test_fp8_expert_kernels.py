"""The block recipes' expert GEMMs on the GPU kernels, shown on this CPU with stand-ins
(megamoe/model/fp8/block_pad.py, rowwise_grouped.py).

No GPU runs here: the device's capability is faked (block_gemm.device_capability), and
each kernel is replaced by a stand-in that first runs the real kernel on meta tensors
(torch's own shape, stride and dtype checks) and then computes what the kernel computes
from the FP8 values and scales in fp32. Every comparison is against the CPU path (no
padding, the per-expert loop of the exact reference): equal up to fp32 accumulation order
(an fp32 output: rtol 1e-5) or one bf16 rounding of the output (a bf16 output: rtol 2^-7,
the spacing of bf16 values relative to the value).
"""

from __future__ import annotations

import pytest
import torch

from megamoe.config.fp8 import Fp8Config
from megamoe.model.fp8 import block_gemm, block_pad, rowwise_grouped
from megamoe.model.fp8.blocks import BlockQ, quantize_operand
from megamoe.model.fp8.grouped import fp8_grouped_mm
from megamoe.model.fp8.policy import Fp8State
from megamoe.model.fp8.quantize import E4M3

CPU = torch.device("cpu")
SIZES = [0, 40, 130, 1]  # dropless: an empty expert and counts no kernel takes as they are


def _bits(q: BlockQ):
    return q.data.view(torch.uint8), q.scale_inv, q.tile


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8", "rowwise"])
def test_padding_the_fp8_operand_equals_quantising_zero_rows(recipe):
    """Zero rows / columns change no tile's amax: the padded FP8 operand is bit for bit
    the quantisation of the zero-padded tensor (rows for forward and dgrad, the
    contraction for wgrad; an empty expert included)."""
    torch.manual_seed(0)
    for x, rows, cols in [(torch.randn(37, 70), 128, 70), (torch.randn(37, 70) * 1e3, 37, 128),
                          (torch.randn(0, 70), 16, 70), (torch.randn(64, 0), 64, 16)]:
        want = quantize_operand(torch.nn.functional.pad(x, (0, cols - x.shape[1],
                                                            0, rows - x.shape[0])), recipe, E4M3)
        got = block_pad.pad_block(quantize_operand(x, recipe, E4M3), rows, cols, recipe)
        for a, b in zip(_bits(got), _bits(want)):
            assert a == b if isinstance(a, tuple) else torch.equal(a, b)


def _run(fmt, recipe, dtype):
    torch.manual_seed(3)
    x = torch.randn(sum(SIZES), 256, dtype=dtype, requires_grad=True)
    w = torch.randn(len(SIZES), 256, 128, dtype=dtype, requires_grad=True)
    scaling = Fp8State(Fp8Config(format=fmt, recipe=recipe)).new_scaling("e", 3, CPU)
    y = fp8_grouped_mm(x, w, SIZES, scaling)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(dtype))
    return y.detach(), x.grad, w.grad


def _fake_block_kernels(monkeypatch, used):
    """Each block kernel replaced by: its real body on meta tensors, then the exact
    reference GEMM (the products the kernel forms) on the values."""
    reference = block_gemm.reference_mm
    for name in ("_blockwise_kernel", "_mxfp8_kernel", "_rowwise_kernel"):
        real = getattr(block_gemm, name)

        def fake(a, b, out_dtype, real=real, name=name):
            meta = [BlockQ(q.data.to("meta"), q.scale_inv.to("meta"), q.tile) for q in (a, b)]
            assert real(*meta, out_dtype).shape == (a.data.shape[0], b.data.shape[0])
            used.append((name, *a.data.shape, b.data.shape[0]))
            return reference(a, b, out_dtype)
        monkeypatch.setattr(block_gemm, name, fake)
    monkeypatch.setattr(block_gemm, "_probe", lambda *args: True)


@pytest.mark.parametrize("recipe,cap,fmt,on_kernel", [
    ("blockwise", (9, 0), "e4m3", 9), ("mxfp8", (10, 0), "hybrid", 9),
    ("rowwise", (8, 9), "e4m3", 9), ("blockwise", (9, 0), "hybrid", 3)])
def test_block_expert_gemms_reach_the_kernel_padded(monkeypatch, recipe, cap, fmt, on_kernel):
    """With the kernel's capability every expert GEMM (forward, dgrad, wgrad of the three
    experts with rows) reaches the kernel with its rows padded, and the results equal the
    unpadded CPU path; the CPU path pads nothing. Under hybrid the blockwise kernel takes
    the E4M3 forward only (E5M2 gradients run the reference by design, unpadded)."""
    dtype = torch.bfloat16 if recipe == "rowwise" else torch.float32  # CUDA rowwise: bf16 out
    with monkeypatch.context() as m:
        m.setattr(block_pad, "pad_block", None)  # the CPU path must never pad
        cpu = _run(fmt, recipe, dtype)
    used = []
    _fake_block_kernels(monkeypatch, used)
    monkeypatch.setattr(block_gemm, "KERNEL_STATUS", {})
    monkeypatch.setattr(block_gemm, "device_capability", lambda _d: cap)
    monkeypatch.setattr(rowwise_grouped, "device_capability", lambda _d: cap)
    with pytest.warns() if (recipe, fmt) == ("blockwise", "hybrid") else _nothing():
        gpu = _run(fmt, recipe, dtype)
    assert len(used) == on_kernel
    align = 16 if recipe == "rowwise" else 128
    assert all(d % align == 0 for call in used for d in call[1:])
    tol = dict(rtol=2 ** -7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-3)
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a, b, **tol)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _grouped_stand_in(calls):
    """torch._scaled_grouped_mm from its definition (row-wise scales: per row of a, per
    column of b; 2-D x 2-D: scale_a[e * rows + i], scale_b[e * cols + j]), after torch's
    meta checks and the CUDA kernel's device asserts on 2-D x 2-D groups (non-empty,
    multiples of 16: aten/src/ATen/native/cuda/GroupMMCommon.cuh)."""
    def stand_in(a, b, scale_a, scale_b, offs=None, out_dtype=None):
        torch._scaled_grouped_mm(a.to("meta"), b.to("meta"), scale_a.to("meta"),
                                 scale_b.to("meta"), offs=offs.to("meta"), out_dtype=out_dtype)
        calls.append(a.dim() + b.dim())
        ends = [0] + offs.tolist()
        groups = list(zip(ends, ends[1:]))
        if b.dim() == 3:
            return torch.cat([(a[lo:hi].float() * scale_a[lo:hi, None])
                              @ (b[e].float() * scale_b[e]) for e, (lo, hi) in
                              enumerate(groups)]).to(out_dtype)
        assert all(hi - lo > 0 and (hi - lo) % 16 == 0 for lo, hi in groups), groups
        R, C = a.shape[0], b.shape[1]
        return torch.stack([(a[:, lo:hi].float() * scale_a[e * R:(e + 1) * R, None])
                            @ (b[lo:hi].float() * scale_b[e * C:(e + 1) * C])
                            for e, (lo, hi) in enumerate(groups)]).to(out_dtype)
    return stand_in


@pytest.mark.parametrize("cap,fmt,want", [((9, 0), "e4m3", [5, 5, 4]), ((9, 0), "hybrid", [5]),
                                          ((8, 9), "e4m3", []), (None, "e4m3", [])])
def test_rowwise_experts_on_scaled_grouped_mm(monkeypatch, cap, fmt, want):
    """rowwise experts on sm90: each E4M3 x E4M3 GEMM is one torch._scaled_grouped_mm
    (after its probe: a forward and a wgrad), with layouts torch's checks accept, equal to
    the per-expert loop; hybrid's E5M2 gradients and other devices run the loop."""
    calls = []
    monkeypatch.setattr(rowwise_grouped, "_scaled_grouped_mm", _grouped_stand_in(calls))
    monkeypatch.setattr(block_gemm, "KERNEL_STATUS", {})
    monkeypatch.setattr(block_gemm, "KERNEL_STATUS", {})
    torch.manual_seed(2)
    sizes = [16, 0, 37, 5]
    x0, w0 = torch.randn(58, 32).bfloat16(), torch.randn(4, 32, 48).bfloat16()
    res = []
    for c in (cap, None):
        monkeypatch.setattr(rowwise_grouped, "device_capability", lambda _d, c=c: c)
        monkeypatch.setattr(block_gemm, "device_capability", lambda _d, c=c: c)
        scaling = Fp8State(Fp8Config(format=fmt, recipe="rowwise")).new_scaling("e", 3, CPU)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fp8_grouped_mm(x, w, sizes, scaling)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).bfloat16())
        res.append((y, x.grad, w.grad))
    assert calls == ([5, 4] + want if want else [])  # the probe, then the GEMMs
    assert bool((res[0][2][1] == 0).all())  # the empty expert's weight gradient
    for a, b in zip(*res):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("broken", ["off_by_a_step", "raises"])
def test_rowwise_grouped_probe_keeps_the_loop_for_a_wrong_kernel(monkeypatch, broken):
    """A grouped kernel one E4M3 step off (x 1.0625), or one that raises (a torch build
    without it), fails the probe once, with a warning: the per-expert loop runs after."""
    calls = []
    right = _grouped_stand_in(calls)

    def wrong(*args, **kwargs):
        if broken == "raises":
            raise RuntimeError("no kernel")
        return (right(*args, **kwargs).float() * 1.0625).bfloat16()
    monkeypatch.setattr(rowwise_grouped, "_scaled_grouped_mm", wrong)
    monkeypatch.setattr(block_gemm, "KERNEL_STATUS", {})
    monkeypatch.setattr(rowwise_grouped, "device_capability", lambda _d: (9, 0))
    with pytest.warns(UserWarning, match="failed its probe"):
        assert not rowwise_grouped.usable("rowwise", CPU, E4M3, E4M3, torch.bfloat16, 32, 48)
    assert not rowwise_grouped.usable("rowwise", CPU, E4M3, E4M3, torch.bfloat16, 32, 48)
    assert calls == ([] if broken == "raises" else [5, 4])  # one probe, never again
    monkeypatch.setattr(rowwise_grouped, "_scaled_grouped_mm", right)
    monkeypatch.setattr(block_gemm, "KERNEL_STATUS", {})
    assert rowwise_grouped.usable("rowwise", CPU, E4M3, E4M3, torch.bfloat16, 32, 48)
