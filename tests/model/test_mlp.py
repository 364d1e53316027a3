"""Dense MLP against explicit formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.config import ModelConfig
from megamoe.model.mlp import MLP


@pytest.mark.parametrize("swiglu,bias,fusion", [(True, False, True), (False, True, True),
                                                (False, True, False), (True, True, True)])
def test_mlp_matches_formula(swiglu, bias, fusion):
    """GELU with biases is Megatron's fused tanh GELU unless --no-bias-gelu-fusion."""
    torch.manual_seed(0)
    c = ModelConfig(hidden_size=8, ffn_hidden_size=12, swiglu=swiglu, add_bias_linear=bias,
                    bias_gelu_fusion=fusion)
    mlp = MLP(c)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
    x = torch.randn(3, 2, 8)
    w1, w2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    b1 = mlp.linear_fc1.bias if bias else torch.zeros(w1.shape[0])
    b2 = mlp.linear_fc2.bias if bias else torch.zeros(8)
    h = x @ w1.t() + b1
    if swiglu:
        assert w1.shape == (24, 8)
        h = F.silu(h[..., :12]) * h[..., 12:]
    else:
        assert w1.shape == (12, 8)
        h = (0.5 * h * (1 + torch.tanh(0.79788456 * h * (1 + 0.044715 * h * h))) if fusion
             else 0.5 * h * (1 + torch.erf(h / 2**0.5)))
    torch.testing.assert_close(mlp(x), h @ w2.t() + b2, atol=1e-5, rtol=1e-5)
    assert (mlp.linear_fc1.bias is not None) == bias
