"""num_parameters equals the module's count; flops_per_token equals a hand computation."""

from __future__ import annotations

import pytest
import torch

from megamoe.config import ModelConfig, MoEConfig
from megamoe.model import GPTModel, flops_per_token, num_parameters

DENSE = [
    dict(),
    dict(untie_embeddings_and_output_weights=True, add_bias_linear=False),
    dict(normalization="RMSNorm", swiglu=True, num_query_groups=2, kv_channels=24,
         position_embedding_type="rope"),
    dict(position_embedding_type="none", vocab_size=1000, make_vocab_size_divisible_by=64),
    dict(qk_layernorm=True, kv_channels=20),  # LayerNorm: weight and bias per head dim
    dict(qk_layernorm=True, normalization="RMSNorm", num_query_groups=2),
    dict(qk_layernorm=True, qk_layernorm_scope="projection", normalization="RMSNorm",
         num_query_groups=2, kv_channels=20),  # whole q and k projections
    dict(add_qkv_bias=True, add_bias_linear=False, num_query_groups=2),
]
MOE = [
    dict(moe_layer_pattern=[1, 1, 1]),
    dict(moe_layer_pattern=[0, 1, 0], swiglu=True, add_bias_linear=False,
         untie_embeddings_and_output_weights=True, num_query_groups=1),
    dict(moe_layer_pattern=[1, 0, 1], normalization="RMSNorm", swiglu=True),
]


def _config(kw: dict, moe: bool = False) -> ModelConfig:
    base = dict(num_layers=3, hidden_size=48, ffn_hidden_size=80, num_attention_heads=4,
                vocab_size=300, seq_length=32, max_position_embeddings=32)
    if moe:
        base["moe"] = MoEConfig(num_experts=5, topk=2, ffn_hidden_size=36)
    base.update(kw)
    return ModelConfig(**base)


def _count(c: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPTModel(c).parameters())


def _expert_params(c: ModelConfig) -> int:
    f, h = c.moe.ffn_hidden_size, c.hidden_size
    fc1 = 2 * f if c.swiglu else f
    return h * fc1 + f * h + ((fc1 + h) if c.add_bias_linear else 0)


@pytest.mark.parametrize("kw", DENSE)
def test_dense_parameter_count(kw):
    c = _config(kw)
    total, active = num_parameters(c)
    assert total == active == _count(c)


@pytest.mark.parametrize("kw", MOE)
def test_moe_parameter_count(kw):
    pytest.importorskip("megamoe.moe.layer")
    c = _config(kw, moe=True)
    total, active = num_parameters(c)
    assert total == _count(c)
    n_moe = sum(c.moe_layer_pattern)
    assert total - active == n_moe * (c.moe.num_experts - c.moe.topk) * _expert_params(c)


@pytest.mark.parametrize("gate", [False, True])
def test_shared_experts_are_counted_as_active(gate):
    c = _config(dict(moe_layer_pattern=[1, 0, 1], swiglu=True), moe=True)
    c.moe.shared_expert_intermediate_size, c.moe.shared_expert_gate = 40, gate
    total, active = num_parameters(c)
    assert total == _count(c)
    assert total - active == 2 * (c.moe.num_experts - c.moe.topk) * _expert_params(c)
    plain = _config(dict(moe_layer_pattern=[1, 0, 1], swiglu=True), moe=True)
    shared_mm = 48 * 80 + 40 * 48 + (48 if gate else 0)  # fc1 (2 x 40) + fc2 (+ gate)
    assert flops_per_token(c) - flops_per_token(plain) == 6 * 2 * shared_mm


def test_flops_per_token_by_hand():
    # L=2, H=64, 4 heads of 16, 2 kv groups, swiglu, layer 0 dense (F=128),
    # layer 1 MoE (E=8, k=2, F=32), S=256, vocab 1000 (padded 1024: padding not counted).
    c = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    num_query_groups=2, seq_length=256, max_position_embeddings=256,
                    vocab_size=1000, swiglu=True,
                    add_bias_linear=False, moe=MoEConfig(num_experts=8, topk=2,
                                                         ffn_hidden_size=32),
                    moe_layer_pattern=[0, 1])
    attn = 64 * (4 + 2 * 2) * 16 + 64 * 64
    dense = 64 * 256 + 128 * 64
    moe = 8 * 64 + 2 * (64 * 64 + 32 * 64)
    matmul = 2 * attn + dense + moe + 1000 * 64
    want = 6 * matmul + 12 * 2 * 256 * 64
    assert flops_per_token(c) == float(want)


def test_flops_scale_with_topk_not_experts():
    c = _config(dict(moe_layer_pattern=[1, 1, 1]), moe=True)
    c8 = _config(dict(moe_layer_pattern=[1, 1, 1]), moe=True)
    c8.moe.num_experts = 64
    router_delta = 6 * 3 * (64 - 5) * c.hidden_size
    assert flops_per_token(c8) - flops_per_token(c) == router_delta
