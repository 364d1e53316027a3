"""Every grouped GEMM backend equals the per-expert loop, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.moe.grouped_gemm import available_backends, grouped_mm, resolve_backend

BACKENDS = [b for b in available_backends() if b != "loop"] + ["auto"]
SIZES = {
    "uneven": [5, 17, 1, 9],
    "zero_experts": [0, 12, 0, 7],
    "one_expert": [0, 0, 21, 0],
    "empty": [0, 0, 0, 0],
}


def _naive(x, w, sizes):
    """Row by row: the definition, independent of the loop backend's split/cat."""
    expert = [e for e, n in enumerate(sizes) for _ in range(n)]
    rows = [x[i] @ w[e] for i, e in enumerate(expert)]
    return torch.stack(rows) if rows else x @ (0 * w.sum(0))  # keeps x and w in the graph


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def _tol(dtype: torch.dtype, want: torch.Tensor) -> float:
    """fp32: 1e-5 absolute; bf16: 2% of the largest magnitude (8 mantissa bits)."""
    if dtype == torch.float32:
        return 1e-5
    return 2e-2 * max(1.0, float(want.detach().abs().max()) if want.numel() else 0.0)


def _run(backend, x, w, tpe, grad):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = grouped_mm(x, w, tpe, backend)
    (y * grad).sum().backward()
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("backend", ["loop", *BACKENDS])
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_reference(backend, sizes, dtype):
    torch.manual_seed(0)
    K, M = 16, 24
    tpe = torch.tensor(sizes)
    x = torch.randn(sum(sizes), K).to(dtype)
    w = torch.randn(len(sizes), K, M).to(dtype)
    grad = torch.randn(sum(sizes), M).to(dtype)
    y, gx, gw = _run(backend, x, w, tpe, grad)
    # fp64 reference from the definition.
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    ref = _naive(x64, w64, sizes)
    (ref * grad.double()).sum().backward()
    assert y.dtype == dtype and y.shape == (sum(sizes), M)
    for got, want in [(y, ref), (gx, x64.grad), (gw, w64.grad)]:
        assert got.shape == want.shape
        assert _maxdiff(got, want) <= _tol(dtype, want)
    if backend != "loop":  # and close to the loop backend
        yl, gxl, gwl = _run("loop", x, w, tpe, grad)
        for got, want in [(y, yl), (gx, gxl), (gw, gwl)]:
            assert _maxdiff(got, want) <= _tol(dtype, want)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")
def test_torch_backend_expanded_gradient():
    """.sum() hands grouped_mm a stride-0 gradient; the wrapper must make it contiguous."""
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    grouped_mm(x, w, torch.tensor([3, 0, 7]), "torch").sum().backward()
    assert torch.allclose(w.grad[1], torch.zeros(8, 4))
    assert torch.allclose(w.grad[0], x[:3].detach().sum(0).unsqueeze(1).expand(8, 4))


def test_auto_falls_back_to_loop_for_unaligned_shapes():
    x = torch.randn(6, 5)
    w = torch.randn(2, 5, 3)
    assert resolve_backend(x, w, "auto") == "loop"
    assert resolve_backend(x.double(), torch.randn(2, 5, 8).double(), "auto") == "loop"
    y = grouped_mm(x, w, torch.tensor([2, 4]))
    assert torch.allclose(y, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))
    if "torch" in available_backends():
        assert resolve_backend(torch.randn(6, 8), torch.randn(2, 8, 4), "auto") == "torch"
        with pytest.raises(ValueError, match="16 bytes"):
            grouped_mm(x, w, torch.tensor([2, 4]), "torch")


def test_bad_arguments():
    x, w = torch.randn(6, 8), torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match="sum to 5"):
        grouped_mm(x, w, torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="3 group sizes"):
        grouped_mm(x, w, torch.tensor([2, 3, 1]))
    with pytest.raises(ValueError, match="unknown"):
        grouped_mm(x, w, torch.tensor([2, 4]), "cuda_magic")
    if "grouped_gemm" not in available_backends():
        with pytest.raises(ValueError, match="grouped_gemm"):
            grouped_mm(x, w, torch.tensor([2, 4]), "grouped_gemm")
