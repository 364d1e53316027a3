"""Self-attention (GQA, RoPE, bias) against a naive explicit implementation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megamoe.config import ModelConfig
from megamoe.model.attention import SelfAttention, split_qkv_weight
from megamoe.model.rope import apply_rotary, rotary_cos_sin


def naive_attention(attn: SelfAttention, c: ModelConfig, x_SBH: torch.Tensor, rotary=None):
    """Explicit math: softmax(q k^T / sqrt(d) + causal mask) v, GQA by repeating kv heads."""
    s, b, _ = x_SBH.shape
    nq, ng, d = c.num_attention_heads, c.num_query_groups, c.kv_channels
    w = attn.linear_qkv.weight
    wq, wk, wv = split_qkv_weight(w, c)
    bq, bk, bv = (split_qkv_weight(attn.linear_qkv.bias, c) if c.add_bias_linear
                  else (0.0, 0.0, 0.0))
    q = (x_SBH @ wq.t() + bq).view(s, b, nq, d)
    k = (x_SBH @ wk.t() + bk).view(s, b, ng, d)
    v = (x_SBH @ wv.t() + bv).view(s, b, ng, d)
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    rep = nq // ng
    k = k.repeat_interleave(rep, dim=2)  # query head h uses kv group h // rep
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    o = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, nq * d)
    out = o @ attn.linear_proj.weight.t()
    if c.add_bias_linear:
        out = out + attn.linear_proj.bias
    return out


@pytest.mark.parametrize("groups,bias,rope,kv", [
    (4, True, False, None), (2, False, True, None), (1, True, True, 6), (2, False, True, 12),
])
def test_attention_matches_naive(groups, bias, rope, kv):
    torch.manual_seed(0)
    c = ModelConfig(hidden_size=16, num_attention_heads=4, num_query_groups=groups,
                    kv_channels=kv, add_bias_linear=bias, attention_dropout=0.0)
    attn = SelfAttention(c).double()
    if bias:
        with torch.no_grad():
            attn.linear_qkv.bias.normal_()
            attn.linear_proj.bias.normal_()
    s, b = 7, 3
    x = torch.randn(s, b, 16, dtype=torch.float64, requires_grad=True)
    rotary = None
    if rope:
        cos, sin = rotary_cos_sin(s, c.kv_channels, 10000.0)
        rotary = (cos.double(), sin.double())
    out = attn(x, rotary)
    ref = naive_attention(attn, c, x, rotary)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, attn.linear_qkv.weight], g)
    want = torch.autograd.grad(ref, [x, attn.linear_qkv.weight], g)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_qk_layernorm_normalises_each_head_before_rope(normalization):
    """--qk-layernorm (Megatron's meaning): one norm over each query and key head's channels,
    its weights shared by the heads, applied before RoPE."""
    torch.manual_seed(0)
    c = ModelConfig(hidden_size=16, num_attention_heads=4, num_query_groups=2,
                    attention_dropout=0.0, qk_layernorm=True, normalization=normalization)
    attn = SelfAttention(c).double()
    with torch.no_grad():
        for norm in (attn.q_layernorm, attn.k_layernorm):
            norm.weight.normal_()
            if getattr(norm, "bias", None) is not None:
                norm.bias.normal_()
    s, b, d = 5, 2, c.kv_channels
    x = torch.randn(s, b, 16, dtype=torch.float64)
    cos, sin = rotary_cos_sin(s, d, 10000.0)
    rotary = (cos.double(), sin.double())
    out = attn(x, rotary)

    def norm(t, m):  # by hand, over the last (head) dimension
        if normalization == "RMSNorm":
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_epsilon) * m.weight
        return torch.nn.functional.layer_norm(t, (d,), m.weight, m.bias, c.norm_epsilon)

    wq, wk, wv = split_qkv_weight(attn.linear_qkv.weight, c)
    q = apply_rotary(norm((x @ wq.t()).view(s, b, 4, d), attn.q_layernorm), *rotary)
    k = apply_rotary(norm((x @ wk.t()).view(s, b, 2, d), attn.k_layernorm), *rotary)
    v = (x @ wv.t()).view(s, b, 2, d)
    k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, 4 * d)
    torch.testing.assert_close(out, o @ attn.linear_proj.weight.t(), atol=1e-10, rtol=1e-10)


def test_add_qkv_bias_puts_a_bias_in_qkv_only():
    """--add-qkv-bias (Megatron, Qwen2): a QKV bias without the other linear biases; the
    attention matches the naive one with that bias."""
    torch.manual_seed(0)
    c = ModelConfig(hidden_size=16, num_attention_heads=4, num_query_groups=2,
                    add_bias_linear=False, add_qkv_bias=True, attention_dropout=0.0)
    attn = SelfAttention(c).double()
    assert attn.linear_qkv.bias is not None and attn.linear_proj.bias is None
    with torch.no_grad():
        attn.linear_qkv.bias.normal_()
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    b_q, b_k, b_v = split_qkv_weight(attn.linear_qkv.bias, c)
    q_w, k_w, v_w = split_qkv_weight(attn.linear_qkv.weight, c)
    s, b, d = 5, 2, c.kv_channels
    q = (x @ q_w.t() + b_q).view(s, b, 4, d)
    k = (x @ k_w.t() + b_k).view(s, b, 2, d).repeat_interleave(2, dim=2)
    v = (x @ v_w.t() + b_v).view(s, b, 2, d).repeat_interleave(2, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, 4 * d)
    torch.testing.assert_close(attn(x), o @ attn.linear_proj.weight.t(), atol=1e-10,
                               rtol=1e-10)


def test_attention_dropout_only_in_training():
    torch.manual_seed(0)
    c = ModelConfig(hidden_size=16, num_attention_heads=4, attention_dropout=0.5)
    attn = SelfAttention(c)
    x = torch.randn(6, 2, 16)
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x))
    attn.train()
    assert not torch.allclose(attn(x), attn(x))


def test_attention_rejects_bad_groups():
    with pytest.raises(ValueError):
        SelfAttention(ModelConfig(hidden_size=16, num_attention_heads=4, num_query_groups=3))


def test_use_flash_attn_runs_the_flash_kernel_only():
    """--use-flash-attn: SDPA restricted to its flash kernel: the same output where that
    kernel runs (no dropout on the CPU kernel), and an error, not a silent fallback, where
    it cannot (dropout on CPU)."""
    torch.manual_seed(0)
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                         num_query_groups=2, seq_length=8, max_position_embeddings=8,
                         attention_dropout=0.0, position_embedding_type="rope")
    plain = SelfAttention(config)
    flash = SelfAttention(dataclasses.replace(config, use_flash_attn=True))
    flash.load_state_dict(plain.state_dict())
    x = torch.randn(8, 2, 32)
    cos, sin = rotary_cos_sin(8, 8, 10000.0)
    torch.testing.assert_close(flash(x, (cos, sin)), plain(x, (cos, sin)))
    flash.attention_dropout = 0.1
    with pytest.raises(RuntimeError, match="No available kernel"):
        flash.train()(x, (cos, sin))
