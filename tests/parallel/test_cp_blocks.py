"""Context-parallel attention blocks on the SDPA kernels (megamoe/parallel/cp_blocks.py):
the kernel path is the one taken where no mask is needed, it equals the single-process
attention and the explicit blocks (fp64, 1e-12 as the existing parity tests: the CPU flash
op accumulates in the input's dtype, so only rounding differs), the layout's block plan
is exactly the causal mask, and one block's transient memory grows linearly in its
length (the explicit block's quadratically)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megamoe.parallel import cp_blocks
from megamoe.parallel.context_parallel import cp_attention
from megamoe.parallel.cp_layout import block_plan, causal_mask, cp_positions, split_for_cp
from tests.distributed import run_distributed
from tests.parallel.test_cp_attention import _inputs
from tools.memory_tracking import allocator_peak


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_block_plan_is_the_causal_mask(cp):
    """For every rank and source rank, the plan's visible rows/columns (causal on the
    diagonal) are exactly the load-balanced layout's causal mask."""
    s_local = 2 * 5
    for rank in range(cp):
        for src in range(cp):
            want = causal_mask(cp_positions(s_local, rank, cp, "cpu"),
                               cp_positions(s_local, src, cp, "cpu"), None, None)[0, 0]
            plan = block_plan(rank, src, cp, s_local)
            got = torch.zeros(s_local, s_local, dtype=torch.bool)
            part = got[plan.q_from:, :plan.k_to]
            part[:] = True
            if plan.causal:
                part[:] = part.tril()
            assert torch.equal(got, want), (rank, src)


def _reference(q, k, v, dout, scale):
    """Causal softmax(q k^T * scale) v written out (GQA by repetition), and its grads."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep, s = q.shape[1] // k.shape[1], q.shape[2]
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * scale
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v.repeat_interleave(
        rep, 1)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _kernel_worker(rank, world_size, comm_type):
    """This rank's errors against the written-out reference, for the GQA shape (equal head
    dims) and MLA's (K wider than V, own scale), and the kernel calls per forward and
    backward; also the kernel path against the explicit blocks."""
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = cp_blocks.kernel_forward, cp_blocks.kernel_backward

    def spy_forward(*a, **k):
        calls["forward"] += 1
        return fwd(*a, **k)

    def spy_backward(*a, **k):
        calls["backward"] += 1
        return bwd(*a, **k)

    import megamoe.parallel.context_parallel as cpmod
    cpmod.kernel_forward, cpmod.kernel_backward = spy_forward, spy_backward
    group = dist.new_group(list(range(world_size)))
    errs = []
    for k_dim, v_dim, scale in ((8, 8, 8 ** -0.5), (12, 6, 0.37)):
        q, k, v, dout, _ = _inputs(k_dim, v_dim, seed=2)
        ref = _reference(q, k, v, dout, scale)
        got = []
        for explicit in (False, True):
            local = [split_for_cp(t, rank, world_size, dim=2).clone().requires_grad_()
                     for t in (q, k, v)]
            with cp_blocks.explicit_blocks() if explicit else _nothing():
                out = cp_attention(*local, group, comm_type, scale=scale)
                out.backward(split_for_cp(dout, rank, world_size, dim=2))
            got.append((out.detach(), *(t.grad for t in local)))
        want = [split_for_cp(t, rank, world_size, dim=2) for t in ref]
        errs += [float((a - b).abs().max()) for a, b in zip(got[0], want)]
        errs += [float((a - b).abs().max()) for a, b in zip(got[0], got[1])]
    return errs, calls


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("cp,comm_type", [
    (2, "p2p"), pytest.param(4, "p2p", marks=pytest.mark.slow),
    pytest.param(4, "allgather", marks=pytest.mark.slow)])
def test_kernel_blocks_are_used_and_equal_full_attention(cp, comm_type):
    """Without document ids or dropout every block runs on the kernel (a spy counts CP
    forward and CP backward block calls per shape, and none under `explicit_blocks`);
    output and q/k/v gradients equal the single-process reference and the explicit
    blocks, for equal head dims and MLA's unequal ones."""
    for errs, calls in run_distributed(_kernel_worker, cp, 120, comm_type):
        assert max(errs) < 1e-12, errs
        assert calls == {"forward": 2 * cp, "backward": 2 * cp}, calls


def test_document_ids_and_dropout_take_the_explicit_blocks():
    q = torch.randn(1, 2, 8, 4)
    assert cp_blocks.choose_kernel(q, q, q, needs_mask=False) == "cpu_flash"
    assert cp_blocks.choose_kernel(q, q, q, needs_mask=True) is None
    with cp_blocks.explicit_blocks():
        assert cp_blocks.choose_kernel(q, q, q, needs_mask=False) is None
    assert cp_blocks.choose_kernel(q.to("meta"), q, q, needs_mask=False) is None


@pytest.mark.parametrize("backend,want", [("auto", "cpu_flash"), ("flash", "cpu_flash"),
                                           ("unfused", None), ("local", None)])
def test_attention_backend_governs_the_blocks(backend, want):
    """--attention-backend means under CP what it means for SDPA: the layers enter the same
    kernel context (model/attention_backend.py) around cp_attention, so unfused/local
    (MATH only) compute the scores explicitly and flash keeps the flash kernel."""
    from megamoe.model.attention_backend import kernel_context

    q = torch.randn(1, 2, 8, 4)
    with kernel_context(backend, False, False):
        assert cp_blocks.choose_kernel(q, q, q, needs_mask=False) == want
    assert cp_blocks.choose_kernel(q, q, q, needs_mask=False) == "cpu_flash"  # restored


def _one_block_peak(kernel, length: int) -> int:
    """Allocator peak of one causal block's forward and backward at `length` tokens."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, length, 16, generator=g) for _ in range(4))
    mask = torch.ones(length, length, dtype=torch.bool).tril()

    def run():
        if kernel is None:
            out, lse = cp_blocks.explicit_forward(q, k, v, mask, 0.25)
            delta = (dout * out).sum(-1)
            cp_blocks.explicit_backward(q, k, v, lse, dout, delta, mask, 0.25)
        else:
            out, lse = cp_blocks.kernel_forward(kernel, q, k, v, True, 0.25)
            cp_blocks.kernel_backward(kernel, dout, q, k, v, out, lse, True, 0.25)

    return allocator_peak(run) + (0 if kernel else mask.nbytes)  # the mask is the block's


def test_one_kernel_block_grows_linearly_in_memory():
    """Peak transient bytes (every CPU allocation, the kernels' own scratch included) of
    one block forward + backward at 4x the length: about 4x or less on the kernel (its
    tiles are of fixed size), 16x on the explicit block ([Sq, Sk] scores)."""
    short, long = 512, 2048
    kernel = _one_block_peak("cpu_flash", long) / _one_block_peak("cpu_flash", short)
    explicit = _one_block_peak(None, long) / _one_block_peak(None, short)
    assert kernel < 6, kernel
    assert explicit > 12, explicit


@pytest.mark.parametrize("kernel,dtype,v_dim", [
    ("cuda_flash", torch.bfloat16, 8), ("cuda_efficient", torch.float32, 6)])
def test_cuda_kernel_calls_are_well_formed(kernel, dtype, v_dim):
    """The CUDA ops' calls (argument lists, the padded lse of the efficient op, GQA
    expansion and the group sums) checked against PyTorch's meta kernels for them: no GPU
    here, so shapes and signatures are what can be checked (values: a GPU's self-test)."""
    q = torch.empty(2, 4, 40, 8, dtype=dtype, device="meta")
    k = torch.empty(2, 2, 24, 8, dtype=dtype, device="meta")
    v = torch.empty(2, 2, 24, v_dim, dtype=dtype, device="meta")
    out, lse = cp_blocks.kernel_forward(kernel, q, k, v, False, 0.3)
    assert (out.shape, out.dtype) == ((2, 4, 40, v_dim), torch.float32)
    assert (lse.shape, lse.dtype) == ((2, 4, 40), torch.float32)
    dout = torch.empty(2, 4, 40, v_dim, dtype=dtype, device="meta")
    dq, dk, dv = cp_blocks.kernel_backward(kernel, dout, q, k, v, out.to(dtype), lse, False,
                                           0.3)
    assert [t.shape for t in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
    assert (dk.dtype, dv.dtype) == (torch.float32, torch.float32)


@pytest.mark.parametrize("v_dim", [16, 8])
def test_bf16_kernel_block_matches_fp32_explicit_block(v_dim):
    """A bf16 block on the CPU flash kernel (GQA; MLA's narrower V when v_dim = 8) equals
    the fp32 explicit block on the same (bf16-representable) inputs to bf16 rounding: the
    kernel rounds its output and dq to bf16 (2^-8 relative), so 2e-2 of each tensor's
    largest magnitude allows a few roundings and nothing more (a wrong lse base or a
    missing group sum is off by O(1))."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 64, 16, generator=g).bfloat16()
    k = torch.randn(1, 2, 64, 16, generator=g).bfloat16()
    v = torch.randn(1, 2, 64, v_dim, generator=g).bfloat16()
    dout = torch.randn(1, 4, 64, v_dim, generator=g).bfloat16()
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    out, lse = cp_blocks.kernel_forward("cpu_flash", q, k, v, True, 0.3)
    grads = cp_blocks.kernel_backward("cpu_flash", dout, q, k, v, out.bfloat16(), lse, True,
                                      0.3)
    q32, k32, v32, d32 = (t.float() for t in (q, k, v, dout))
    out_ref, lse_ref = cp_blocks.explicit_forward(q32, k32, v32, mask, 0.3)
    delta = (d32 * out_ref).sum(-1)
    ref = cp_blocks.explicit_backward(q32, k32, v32, lse_ref, d32, delta, mask, 0.3)
    assert (lse - lse_ref).abs().max() < 1e-3  # fp32 from bf16 inputs: ~1e-4 seen
    for got, want in zip((out, *grads), (out_ref, *ref)):
        assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
