"""Every grouped GEMM backend equals the per-expert loop, forward and backward."""

from __future__ import annotations

import copy

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


def test_private_torch_grouped_mm_fallback(monkeypatch):
    """torch < 2.10 has no public F.grouped_mm: the "torch" backend then calls the private
    torch._grouped_mm (2.8: CUDA sm90 only, 2.9: also CPU), same arguments, same results."""
    import megamoe.moe.grouped_gemm as gg

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without torch._grouped_mm")
    monkeypatch.delattr(F, "grouped_mm", raising=False)
    assert gg._torch_grouped_mm() == (torch._grouped_mm, "torch._grouped_mm")
    monkeypatch.setattr(gg, "_TORCH_MM", torch._grouped_mm)
    monkeypatch.setattr(gg, "TORCH_GROUPED_MM", "torch._grouped_mm")
    torch.manual_seed(0)
    sizes = [5, 0, 11, 4]
    x, w, grad = torch.randn(20, 16), torch.randn(4, 16, 8), torch.randn(20, 8)
    assert "torch" in gg.available_backends()
    assert resolve_backend(x, w, "auto") == "torch"
    y, gx, gw = _run("torch", x, w, torch.tensor(sizes), grad)
    yl, gxl, gwl = _run("loop", x, w, torch.tensor(sizes), grad)
    for got, want in [(y, yl), (gx, gxl), (gw, gwl)]:
        assert _maxdiff(got, want) <= 1e-5
    monkeypatch.setattr(gg, "_private_cpu_kernel", lambda: False)  # torch 2.8: no CPU kernel
    assert resolve_backend(x, w, "auto") == "loop"
    monkeypatch.delattr(torch, "_grouped_mm")
    assert gg._torch_grouped_mm() == (None, "")
    monkeypatch.setattr(gg, "_TORCH_MM", None)
    assert gg.available_backends() == ["loop"]


class _PackageStandIn:
    """Stands in for the `grouped_gemm` package (grouped_gemm.ops.gmm and the backend.gmm
    its autograd calls), computing with a per-expert loop and recording every call."""

    def __init__(self, counter) -> None:
        self.calls: list[dict] = []
        self.counter = counter  # the package reads batch_sizes on the host: no sync
        stand_in = self

        class _GroupedGemm(torch.autograd.Function):  # as grouped_gemm/ops.py
            @staticmethod
            def forward(ctx, a, b, batch_sizes, trans_b):
                ctx.save_for_backward(a, b, batch_sizes)
                ctx.trans_b = trans_b
                return stand_in.backend_gmm(a, b, batch_sizes, trans_a=False, trans_b=trans_b)

            @staticmethod
            def backward(ctx, grad):
                grad = grad.contiguous()
                a, b, batch_sizes = ctx.saved_tensors
                agrad = stand_in.backend_gmm(grad, b, batch_sizes, trans_a=False,
                                             trans_b=not ctx.trans_b)
                bgrad = stand_in.backend_gmm(a, grad, batch_sizes, trans_a=True, trans_b=False)
                return agrad, bgrad, None, None

        def gmm(a, b, batch_sizes, trans_b=False):
            return _GroupedGemm.apply(a, b, batch_sizes, trans_b)

        self.ops = type("ops", (), {"gmm": staticmethod(gmm)})

    def backend_gmm(self, a, b, batch_sizes, trans_a, trans_b):
        self.calls.append(dict(a=a, b=b, batch_sizes=batch_sizes, trans_a=trans_a,
                               trans_b=trans_b))
        with torch.no_grad(), self.counter.muted():
            chunks = a.split(batch_sizes.tolist())
            if trans_a:  # variable K: [E, K, M] = a_e^T @ b_e
                return torch.stack([a_e.t() @ b_e for a_e, b_e
                                    in zip(chunks, b.split(batch_sizes.tolist()))])
            weights = b.transpose(1, 2) if trans_b else b
            return torch.cat([a_e @ w_e for a_e, w_e in zip(chunks, weights)])


def test_grouped_gemm_package_call_contract(monkeypatch):
    """Contract test: checks how we call the `grouped_gemm` package, not the package (which
    needs CUDA). A stand-in takes the place of the module-level `_gg` and the CUDA check is
    faked; one MoE layer forward + backward must call grouped_gemm.ops.gmm as the real
    package expects (csrc/grouped_gemm.cu: a [N, K] and b [E, K, M] bf16 contiguous,
    batch_sizes 1-D int64 on the CPU summing to N, trans_b=False for our [E, K, M]
    weights), make exactly one host copy of the group sizes per layer call (shared by
    fc1, fc2 and the package's backward), and the stand-in's per-expert results must
    flow through forward and backward like the loop backend's."""
    import megamoe.moe.grouped_gemm as gg
    from megamoe.config import MoEConfig
    from megamoe.moe.experts import use_grouped_gemm
    from megamoe.moe.layer import MoELayer
    from tests.moe.test_host_syncs import HostSyncCounter

    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=32, aux_loss_coeffs=[1e-2])
    layer = MoELayer(cfg, 16, init_method_std=0.3, grouped_gemm=True).to(torch.bfloat16)
    ref = copy.deepcopy(layer)
    use_grouped_gemm(ref, False)  # the per-expert loop, same bf16 weights
    x = torch.randn(12, 16, dtype=torch.bfloat16)
    grad = torch.randn(12, 16, dtype=torch.bfloat16)
    counter = HostSyncCounter()
    stand_in = _PackageStandIn(counter)
    monkeypatch.setattr(gg, "_gg", stand_in)
    monkeypatch.setattr(gg, "_cuda_operands", lambda x_NK, w_EKM: True)
    assert resolve_backend(x, layer.experts.fc1_weight, "auto") == "grouped_gemm"

    x_in, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    with counter:
        out = layer(x_in)
        (out * grad).sum().backward()
    (ref(x_ref) * grad).sum().backward()

    forward_calls = [c for c in stand_in.calls if not c["trans_a"] and not c["trans_b"]]
    assert len(forward_calls) == 2 and len(stand_in.calls) == 6  # fc1, fc2; 2 x 2 backward
    sizes = stand_in.calls[0]["batch_sizes"]
    for call in stand_in.calls:
        assert call["batch_sizes"] is sizes  # one host tensor for every GEMM of the call
        assert call["a"].dtype == call["b"].dtype == torch.bfloat16
        assert call["a"].is_contiguous() and call["b"].is_contiguous()
    for call in forward_calls:
        a, b = call["a"], call["b"]
        assert a.dim() == 2 and b.dim() == 3 and b.shape[1] == a.shape[1]
        assert b.shape[0] == len(sizes) and int(sizes.sum()) == a.shape[0]
    assert sizes.dtype == torch.int64 and sizes.device.type == "cpu" and sizes.dim() == 1
    host_copies = [e for e in counter.events if e[1].startswith("megamoe/moe/grouped_gemm.py")]
    assert [name for name, _ in host_copies] == ["tolist"], counter
    assert counter.total == 2, counter  # that copy and the permutation's nonzero

    torch.testing.assert_close(out, ref(x))
    torch.testing.assert_close(x_in.grad, x_ref.grad)
    for (name, p), p_ref in zip(layer.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)
