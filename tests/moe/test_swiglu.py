"""Fused SwiGLU == the unfused autograd path (forward and gradients), saving only h and p."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.moe.swiglu import swiglu


def _unfused(h_N2F, probs_N):
    gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
    a_NF = F.silu(gate_NF) * up_NF
    return a_NF if probs_N is None else a_NF * probs_N.unsqueeze(-1)


def _run(fn, h_N2F, probs_N, grad_NF):
    h = h_N2F.detach().requires_grad_(True)
    p = None if probs_N is None else probs_N.detach().requires_grad_(True)
    out = fn(h, p)
    out.backward(grad_NF)
    return out.detach(), h.grad, None if p is None else p.grad


@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("rows,ffn", [(37, 24), (1, 4), (0, 8), (256, 256)])
def test_matches_unfused_forward_and_gradients(with_probs, rows, ffn):
    g = torch.Generator().manual_seed(rows * 7 + ffn)
    h = torch.randn(rows, 2 * ffn, generator=g) * 3
    p = torch.rand(rows, generator=g) if with_probs else None
    grad = torch.randn(rows, ffn, generator=g)
    fused = _run(swiglu, h, p, grad)
    ref = _run(_unfused, h, p, grad)
    for a, b in zip(fused, ref):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_matches_unfused_in_float64_and_bf16():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(50, 64, generator=g, dtype=torch.float64)
    p = torch.rand(50, generator=g, dtype=torch.float64)
    grad = torch.randn(50, 32, generator=g, dtype=torch.float64)
    for a, b in zip(_run(swiglu, h, p, grad), _run(_unfused, h, p, grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    hb, pb, gb = h.bfloat16(), p.bfloat16(), grad.bfloat16()
    for a, b in zip(_run(swiglu, hb, pb, gb), _run(_unfused, hb, pb, gb)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_gradcheck():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.rand(6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (h, p))
    assert torch.autograd.gradcheck(lambda x: swiglu(x), (h,))


def test_only_probs_or_only_h_need_grad():
    g = torch.Generator().manual_seed(7)
    h, p = torch.randn(9, 10, generator=g), torch.rand(9, generator=g)
    grads = []
    for fn in (swiglu, _unfused):
        pp = p.clone().requires_grad_(True)
        fn(h, pp).square().sum().backward()
        grads.append(pp.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-6)
    grads = []
    for fn in (swiglu, _unfused):
        hh = h.clone().requires_grad_(True)
        fn(hh, p).square().sum().backward()
        grads.append(hh.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-6)


def test_saves_only_fc1_output_and_probs():
    """Autograd keeps h [N, 2F] and p [N]: none of the [N, F] gate/up/product tensors."""
    h = torch.randn(64, 32, requires_grad=True)
    p = torch.rand(64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        swiglu(h, p)
    assert sorted(t.numel() for t in saved) == [64, 64 * 32]


def test_bad_shapes():
    with pytest.raises(ValueError, match="odd"):
        swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match="probs"):
        swiglu(torch.randn(3, 4), torch.rand(4))
