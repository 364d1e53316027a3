"""permute / unpermute against explicit loops over experts and tokens."""

from __future__ import annotations

import pytest
import torch

from megamoe.moe.permute import permute, permute_probs, unpermute


def _random_map(T: int, E: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    return torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)


def _naive_permute(x, rmap):
    rows, tokens = [], []
    for e in range(rmap.shape[1]):
        for t in range(rmap.shape[0]):
            if rmap[t, e]:
                rows.append(x[t])
                tokens.append(t)
    return torch.stack(rows), torch.tensor(tokens), rmap.sum(0)


@pytest.mark.parametrize("T,E,k", [(13, 4, 1), (20, 8, 2), (9, 3, 3), (16, 6, 6)])
def test_permute_matches_loops(T, E, k):
    torch.manual_seed(0)
    x = torch.randn(T, 5)
    rmap = _random_map(T, E, k, seed=T)
    x_NH, idx_N, tpe = permute(x, rmap)
    ref_x, ref_idx, ref_tpe = _naive_permute(x, rmap)
    assert torch.equal(x_NH, ref_x) and torch.equal(idx_N, ref_idx) and torch.equal(tpe, ref_tpe)
    probs = torch.rand(T, E) * rmap
    probs_N = permute_probs(probs, rmap)
    assert torch.equal(probs_N, torch.stack([probs[t, e] for e in range(E) for t in range(T)
                                             if rmap[t, e]]))


def test_zero_token_experts_and_all_k_experts():
    rmap = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 1, 0, 1]], dtype=torch.bool)
    x = torch.arange(6.0).reshape(3, 2)
    x_NH, idx_N, tpe = permute(x, rmap)
    assert tpe.tolist() == [2, 3, 0, 1]
    assert idx_N.tolist() == [0, 1, 0, 1, 2, 2]
    # Every token routed to all experts (k == E).
    full = torch.ones(3, 4, dtype=torch.bool)
    x_NH, idx_N, tpe = permute(x, full)
    assert tpe.tolist() == [3, 3, 3, 3] and idx_N.tolist() == [0, 1, 2] * 4


def test_round_trip_with_unit_weights_is_k_times_x():
    torch.manual_seed(0)
    T, E, k = 11, 5, 2
    x = torch.randn(T, 7)
    rmap = _random_map(T, E, k, seed=1)
    x_NH, idx_N, _ = permute(x, rmap)
    out = unpermute(x_NH, idx_N, torch.ones(len(idx_N)), T)
    assert torch.allclose(out, k * x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unpermute_and_gradients_match_loops(dtype):
    torch.manual_seed(0)
    T, E, k, H = 10, 4, 2, 3
    rmap = _random_map(T, E, k, seed=3)
    rmap[:, 3] = False  # expert 3 receives nothing
    rmap[:, 0] = True
    x = torch.randn(T, H, dtype=dtype, requires_grad=True)
    probs_TE = (torch.rand(T, E, dtype=dtype) * rmap).requires_grad_(True)
    w = torch.randn(E, H, H, dtype=dtype, requires_grad=True)

    x_NH, idx_N, tpe = permute(x, rmap)
    probs_N = permute_probs(probs_TE, rmap)
    experts_N = torch.repeat_interleave(torch.arange(E), tpe)
    y_NH = torch.einsum("nh,nhm->nm", x_NH, w[experts_N])
    out = unpermute(y_NH, idx_N, probs_N, T)
    grad = torch.randn(T, H, dtype=dtype)
    gx, gp, gw = torch.autograd.grad((out * grad).sum(), [x, probs_TE, w])

    ref = torch.zeros(T, H, dtype=dtype)
    for t in range(T):
        for e in range(E):
            if rmap[t, e]:
                ref[t] = ref[t] + probs_TE[t, e] * (x[t] @ w[e])
    rx, rp, rw = torch.autograd.grad((ref * grad).sum(), [x, probs_TE, w])
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert out.dtype == dtype
    for a, b in [(out, ref), (gx, rx), (gp, rp), (gw, rw)]:
        assert (a - b).abs().max() <= tol


def test_unpermute_accumulates_in_fp32_returns_input_dtype():
    y = torch.tensor([[1.0], [1.0 / 256], [1.0 / 256]], dtype=torch.bfloat16)
    out = unpermute(y, torch.tensor([0, 0, 0]), torch.ones(3), 1)
    assert out.dtype == torch.bfloat16
    # bf16 left-to-right would round 1 + 1/256 back to 1 twice; fp32 keeps 1 + 2/256.
    assert float(out[0, 0]) == pytest.approx(1.0 + 2.0 / 256)


def test_pad_groups_layout():
    from megamoe.moe.permute import pad_groups

    rmap = torch.tensor([[1, 0, 1], [1, 0, 0], [0, 0, 1], [1, 0, 0]], dtype=torch.bool)
    x = torch.arange(4.0).unsqueeze(1)
    probs = torch.rand(4, 3) * rmap
    _, idx, sizes = permute(x, rmap)
    p = permute_probs(probs, rmap)
    idx_P, p_P = pad_groups(idx, p, sizes, capacity=3, pad_index=4)
    assert idx_P.tolist() == [0, 1, 3, 4, 4, 4, 0, 2, 4]
    assert p_P.tolist() == [probs[0, 0], probs[1, 0], probs[3, 0], 0, 0, 0, probs[0, 2],
                            probs[2, 2], 0]
    with pytest.raises(ValueError, match="capacity"):
        pad_groups(idx, p, sizes, capacity=2, pad_index=4)


@pytest.mark.parametrize("T,E,k,capacity", [(13, 4, 1, 5), (20, 8, 2, 6), (9, 3, 3, 9)])
def test_permute_padded_equals_pad_groups(T, E, k, capacity):
    """The sync-free padded layout == permute + pad_groups, and the same gradients."""
    from megamoe.moe.capacity import apply_capacity
    from megamoe.moe.permute import pad_groups, permute_padded

    g = torch.Generator().manual_seed(T)
    probs = (torch.rand(T, E, generator=g) * _random_map(T, E, k, seed=T))
    probs, rmap = apply_capacity(probs, probs > 0, capacity, "position")
    p1, p2 = probs.clone().requires_grad_(), probs.clone().requires_grad_()
    idx_P, probs_P = permute_padded(p1, rmap, capacity, pad_index=T)
    _, idx, sizes = permute(torch.zeros(T, 1), rmap)
    ref_idx, ref_probs = pad_groups(idx, permute_probs(p2, rmap), sizes, capacity, T)
    assert torch.equal(idx_P, ref_idx) and torch.equal(probs_P, ref_probs)
    w = torch.randn(E * capacity, generator=g)
    (probs_P * w).sum().backward()
    (ref_probs * w).sum().backward()
    assert torch.equal(p1.grad, p2.grad)


def test_chunked_rows_are_each_chunks_own_layout():
    """expert_major_rows with chunk sizes: one nonzero, rows = the concatenation of each
    chunk's permutation (token indices global), counts per (chunk, expert)."""
    from megamoe.moe.permute import expert_major_rows, select_probs

    T, E = 11, 4
    rmap = _random_map(T, E, 2, seed=5)
    probs = torch.rand(T, E) * rmap
    rows = expert_major_rows(rmap, [4, 4, 3])
    want_idx, want_tpe, want_probs = [], [], []
    for first, size in ((0, 4), (4, 4), (8, 3)):
        _, idx, tpe = permute(torch.zeros(size, 1), rmap[first:first + size])
        want_idx.append(idx + first)
        want_tpe.append(tpe)
        want_probs.append(permute_probs(probs[first:first + size], rmap[first:first + size]))
    assert torch.equal(rows.token_indices_N, torch.cat(want_idx))
    assert torch.equal(rows.tokens_per_expert_E, torch.cat(want_tpe))
    assert torch.equal(select_probs(probs, rows), torch.cat(want_probs))
