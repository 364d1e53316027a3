"""--qk-layernorm-scope projection (OLMoE's q/k norm): one RMSNorm over the whole q and
k projections, before the head split and RoPE; under TP=2 the same output and gradients as
the single process (the sum of squares all-reduced over the ranks' heads)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from megamoe.config import ModelConfig
from megamoe.config.fields import ConfigError
from megamoe.model.attention import SelfAttention, split_qkv_weight
from megamoe.model.norms import ProjectionRMSNorm
from megamoe.model.rope import apply_rotary, rotary_cos_sin
from megamoe.parallel.tensor_parallel import TensorParallel, shard_rows
from megamoe.parallelize import apply_tensor_parallel
from tests.distributed import run_distributed


def _config(**kw) -> ModelConfig:
    base = dict(hidden_size=16, num_attention_heads=4, num_query_groups=2,
                attention_dropout=0.0, qk_layernorm=True, qk_layernorm_scope="projection",
                normalization="RMSNorm", norm_epsilon=1e-5)
    return ModelConfig(**{**base, **kw})


def _attention(c: ModelConfig, dtype=torch.float64) -> SelfAttention:
    torch.manual_seed(0)
    attn = SelfAttention(c).to(dtype)
    with torch.no_grad():
        for norm in (attn.q_layernorm, attn.k_layernorm):
            norm.weight.normal_(1.0, 0.5)
    return attn


def test_projection_norm_spans_all_heads_before_rope():
    c = _config()
    attn = _attention(c)
    assert isinstance(attn.q_layernorm, ProjectionRMSNorm)
    assert attn.q_layernorm.weight.shape == (4 * 4,) and attn.k_layernorm.weight.shape == (8,)
    s, b, d = 5, 2, c.kv_channels
    x = torch.randn(s, b, 16, dtype=torch.float64)
    rotary = tuple(t.double() for t in rotary_cos_sin(s, d, 10000.0))

    def rms(t, w):  # by hand, over the whole projection (not per head)
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_epsilon) * w

    wq, wk, wv = split_qkv_weight(attn.linear_qkv.weight, c)
    q = apply_rotary(rms(x @ wq.t(), attn.q_layernorm.weight).view(s, b, 4, d), *rotary)
    k = apply_rotary(rms(x @ wk.t(), attn.k_layernorm.weight).view(s, b, 2, d), *rotary)
    v = (x @ wv.t()).view(s, b, 2, d)
    k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, 16)
    ref = o @ attn.linear_proj.weight.t()
    torch.testing.assert_close(attn(x, rotary), ref, atol=1e-12, rtol=1e-12)
    # and it is not the per-head norm: the two scopes give different outputs
    per_head = copy.deepcopy(attn)
    per_head.qk_norm_whole = False
    per_head.q_layernorm = torch.nn.RMSNorm(d, eps=c.norm_epsilon).double()
    per_head.k_layernorm = torch.nn.RMSNorm(d, eps=c.norm_epsilon).double()
    assert (per_head(x, rotary) - ref).abs().max() > 1e-3


def test_projection_scope_needs_qk_layernorm_and_rmsnorm():
    with pytest.raises(ConfigError, match="--qk-layernorm-scope projection needs"):
        _config(qk_layernorm=False)
    with pytest.raises(ConfigError, match="not supported yet: --qk-layernorm-scope"):
        _config(normalization="LayerNorm")
    with pytest.raises(ConfigError, match="--qk-layernorm-scope must be one of"):
        _config(qk_layernorm_scope="group")


def _grads(attn: SelfAttention, x: torch.Tensor, rotary, g: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = attn(x, rotary)
    params = [attn.linear_qkv.weight, attn.q_layernorm.weight, attn.k_layernorm.weight]
    grads = torch.autograd.grad(out, [x, *params], g)
    return out.detach(), grads


def _tp_worker(rank: int, world: int, sp: bool) -> None:
    c = _config(hidden_size=32, num_attention_heads=4, num_query_groups=2)
    s, b, d = 6, 2, c.kv_channels
    full = _attention(c, torch.float32)
    tp_attn = apply_tensor_parallel(copy.deepcopy(full),
                                    TensorParallel(dist.group.WORLD, sequence_parallel=sp))
    assert tp_attn.q_layernorm.weight.tensor_model_parallel
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(s, b, 32, generator=gen), torch.randn(s, b, 32, generator=gen)
    rotary = rotary_cos_sin(s, d, 10000.0)
    want, want_grads = _grads(full, x, rotary, g)
    # Row-parallel linear_proj: each rank's output is the whole sum (SP: its sequence shard).
    mine = (lambda t: t.chunk(world)[rank]) if sp else (lambda t: t)
    got, got_grads = _grads(tp_attn, mine(x), rotary, mine(g))
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, mine(want), **tol)
    q, kv = 4 * d, 2 * d
    dx, dqkv, dq_norm, dk_norm = want_grads
    torch.testing.assert_close(got_grads[0], mine(dx), **tol)
    torch.testing.assert_close(got_grads[1], shard_rows(dqkv, (q, kv, kv), world, rank), **tol)
    torch.testing.assert_close(got_grads[2], dq_norm.chunk(world)[rank], **tol)
    torch.testing.assert_close(got_grads[3], dk_norm.chunk(world)[rank], **tol)
    # The check can fail: without the all-reduce each rank normalises its own heads only.
    for norm in (tp_attn.q_layernorm, tp_attn.k_layernorm):
        norm.group = None
    assert (tp_attn(mine(x), rotary) - mine(want)).abs().max() > 1e-3


@pytest.mark.parametrize("sp", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["tp2", "tp2_sp"])
def test_projection_norm_under_tp2_matches_single_process(sp):
    run_distributed(_tp_worker, 2, 120, sp)
