"""RoPE against an explicit per-pair rotation."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.model.rope import apply_rotary, rotary_cos_sin, rotary_dim


def naive_rope(x_SBND: torch.Tensor, pos_BS: torch.Tensor, rot: int, base: float):
    """Rotate channel pairs (j, j + rot/2) of each head by angle pos * base^(-2j/rot)."""
    out = x_SBND.clone()
    s, b, n, _ = x_SBND.shape
    half = rot // 2
    for t in range(s):
        for bi in range(b):
            for j in range(half):
                theta = float(pos_BS[bi, t]) * base ** (-2.0 * j / rot)
                c, si = math.cos(theta), math.sin(theta)
                x1, x2 = x_SBND[t, bi, :, j], x_SBND[t, bi, :, j + half]
                out[t, bi, :, j] = x1 * c - x2 * si
                out[t, bi, :, j + half] = x2 * c + x1 * si
    return out


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rope_matches_naive(percent):
    torch.manual_seed(0)
    s, b, n, d = 5, 2, 3, 8
    x = torch.randn(s, b, n, d, dtype=torch.float64)
    rot = rotary_dim(d, percent)
    cos, sin = rotary_cos_sin(s, rot, 10000.0)
    got = apply_rotary(x, cos.double(), sin.double())
    ref = naive_rope(x, torch.arange(s).expand(b, s), rot, 10000.0)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    if percent < 1.0:
        assert torch.equal(got[..., rot:], x[..., rot:])


def test_rope_position_ids():
    torch.manual_seed(0)
    s, b, n, d = 4, 2, 2, 6
    x = torch.randn(s, b, n, d, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3], [7, 3, 0, 1]])
    cos, sin = rotary_cos_sin(s, d, 500.0, position_ids_BS=pos)
    assert cos.shape == (s, b, 1, d)
    got = apply_rotary(x, cos.double(), sin.double())
    torch.testing.assert_close(got, naive_rope(x, pos, d, 500.0), atol=1e-6, rtol=0)
    # Default positions equal explicit arange.
    c0, s0 = rotary_cos_sin(s, d, 500.0)
    c1, s1 = rotary_cos_sin(s, d, 500.0, position_ids_BS=torch.arange(s)[None])
    assert torch.equal(c0, c1) and torch.equal(s0, s1)


def test_rotary_dim_rejects_odd():
    from megamoe.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="rotary dim 3"):
        ModelConfig(hidden_size=24, num_attention_heads=4, position_embedding_type="rope",
                    rotary_percent=0.5)
