"""RMSNorm / LayerNorm selection against explicit formulas."""

from __future__ import annotations

import copy

import pytest
import torch

from megamoe.config import ModelConfig
from megamoe.model.norms import RMSNorm, build_norm


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = torch.randn(3, 2, 8)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), ref)


def test_rmsnorm_bf16_stats_in_fp32():
    torch.manual_seed(0)
    x = torch.randn(4, 16) * 30
    norm = RMSNorm(16)
    out = copy.deepcopy(norm).bfloat16()(x.bfloat16())  # as after model.to(bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), norm(x), atol=2e-2, rtol=1e-2)


def test_build_norm():
    c = ModelConfig(normalization="LayerNorm", norm_epsilon=1e-6)
    ln = build_norm(c, 8)
    assert isinstance(ln, torch.nn.LayerNorm) and ln.eps == 1e-6
    x = torch.randn(2, 8)
    ref = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True)
                                                      + 1e-6)
    torch.testing.assert_close(ln(x), ref, atol=1e-5, rtol=1e-5)
    rms = build_norm(ModelConfig(normalization="RMSNorm", norm_epsilon=1e-3), 8)
    assert isinstance(rms, RMSNorm) and rms.eps == 1e-3
    with pytest.raises(ValueError):
        build_norm(ModelConfig(normalization="BatchNorm"), 8)
