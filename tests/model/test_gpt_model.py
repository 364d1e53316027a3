"""GPTModel: shapes, causality, vocabulary padding, determinism, tying, init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megamoe.config import ModelConfig, MoEConfig
from megamoe.model import GPTModel
from megamoe.model.mlp import MLP


def tiny(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                seq_length=12, max_position_embeddings=16, vocab_size=97,
                hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             add_bias_linear=False, num_query_groups=2, untie_embeddings_and_output_weights=True)


def moe_cfg(**kw) -> MoEConfig:
    base = dict(num_experts=4, topk=2, ffn_hidden_size=24)
    base.update(kw)
    return MoEConfig(**base)


def _tokens(b=2, s=12, v=97, seed=0):
    return torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kw", [{}, LLAMA, dict(position_embedding_type="none")])
def test_shapes_and_loss_is_ce_of_logits(kw):
    torch.manual_seed(0)
    c = tiny(**kw)
    model = GPTModel(c)
    tokens, labels = _tokens(), _tokens(seed=1)
    logits = model(tokens)
    assert logits.shape == (2, 12, 97)
    loss = model(tokens, labels=labels)
    assert loss.shape == (2, 12) and loss.dtype == torch.float32
    ref = F.cross_entropy(logits.reshape(-1, 97), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, ref.view(2, 12))


@pytest.mark.parametrize("kw", [{}, LLAMA])
def test_causal(kw):
    torch.manual_seed(0)
    model = GPTModel(tiny(**kw)).eval()
    tokens = _tokens()
    base = model(tokens)
    t = 5
    changed = tokens.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 1) % 97
    out = model(changed)
    torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=1e-6, rtol=0)
    assert not torch.allclose(out[:, t + 1:], base[:, t + 1:])


@pytest.mark.parametrize("untie", [False, True])
def test_padded_vocab_never_changes_loss(untie):
    tokens, labels = _tokens(), _tokens(seed=1)
    torch.manual_seed(0)
    ref_model = GPTModel(tiny(make_vocab_size_divisible_by=1,
                              untie_embeddings_and_output_weights=untie))
    ref_sd = ref_model.state_dict()
    for m, fixed in ((1, None), (128, None), (128, 150)):  # 150: --padded-vocab-size
        c = tiny(make_vocab_size_divisible_by=m, untie_embeddings_and_output_weights=untie,
                 fixed_padded_vocab_size=fixed)
        assert c.padded_vocab_size == fixed or (97 if m == 1 else 128)
        torch.manual_seed(1)  # padded rows keep their own random (non-zero) values
        model = GPTModel(c)
        sd = model.state_dict()
        for k, v in ref_sd.items():
            sd[k][: v.shape[0]] = v
        model.load_state_dict(sd)
        assert model.embedding.word_embeddings.weight.shape[0] == c.padded_vocab_size
        assert model(tokens).shape[-1] == 97
        torch.testing.assert_close(model(tokens, labels=labels),
                                   ref_model(tokens, labels=labels), atol=0, rtol=0)


def test_dropout_off_is_deterministic_and_on_is_not():
    torch.manual_seed(0)
    tokens = _tokens()
    model = GPTModel(tiny()).train()
    torch.testing.assert_close(model(tokens), model(tokens), atol=0, rtol=0)
    torch.manual_seed(0)
    noisy = GPTModel(tiny(hidden_dropout=0.2, attention_dropout=0.2)).train()
    assert not torch.equal(noisy(tokens), noisy(tokens))
    noisy.eval()
    torch.testing.assert_close(noisy(tokens), noisy(tokens), atol=0, rtol=0)


def test_tied_vs_untied():
    torch.manual_seed(0)
    tied = GPTModel(tiny())
    untied = GPTModel(tiny(untie_embeddings_and_output_weights=True))
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 128 * 32
    assert tied.output_layer is None and tied.output_weight() is \
        tied.embedding.word_embeddings.weight
    assert untied.output_layer.weight.shape == (128, 32)
    # Tied: the embedding gets gradient from both the lookup and the output GEMM.
    tokens = torch.zeros(1, 4, dtype=torch.long)
    tied(tokens, labels=tokens).sum().backward()
    grad_W = tied.embedding.word_embeddings.weight.grad
    assert grad_W[1:97].abs().sum() > 0  # rows never looked up still get output gradient
    assert grad_W[97:].abs().sum() == 0  # padded rows never get any


def test_same_seed_same_weights():
    def build(seed):
        torch.manual_seed(seed)
        return GPTModel(tiny(**LLAMA)).state_dict()

    a, b, c = build(3), build(3), build(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["decoder.layers.0.self_attention.linear_qkv.weight"],
                           c["decoder.layers.0.self_attention.linear_qkv.weight"])


def test_megatron_init():
    torch.manual_seed(0)
    c = ModelConfig(num_layers=8, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                    vocab_size=1000, init_method_std=0.02)
    sd = GPTModel(c).state_dict()
    out_std = 0.02 / math.sqrt(16)
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            assert torch.equal(v, torch.ones_like(v)), k
        elif k.endswith("bias"):
            assert torch.equal(v, torch.zeros_like(v)), k
        else:
            want = out_std if ("linear_proj" in k or "linear_fc2" in k) else 0.02
            assert abs(v.std().item() / want - 1) < 0.05, (k, v.std().item(), want)
            assert abs(v.mean().item()) < want * 0.05, k


def test_position_ids_and_embedding_types():
    torch.manual_seed(0)
    tokens = _tokens()
    for kind in ("learned_absolute", "rope"):
        model = GPTModel(tiny(position_embedding_type=kind))
        default = model(tokens)
        explicit = model(tokens, position_ids=torch.arange(12).expand(2, 12))
        torch.testing.assert_close(default, explicit)
        # Two 6-token documents (--reset-position-ids): relative positions change.
        reset = model(tokens, position_ids=(torch.arange(12) % 6).expand(2, 12))
        assert not torch.allclose(default, reset, atol=1e-4)
        shifted = model(tokens, position_ids=torch.arange(12).expand(2, 12) + 3)
        if kind == "rope":  # rotary attention sees relative positions only
            torch.testing.assert_close(default, shifted, rtol=1e-4, atol=1e-5)
        else:
            assert not torch.allclose(default, shifted, atol=1e-4)
    assert GPTModel(tiny(position_embedding_type="none")).embedding.position_embeddings is None
    with pytest.raises(ValueError):
        GPTModel(tiny(position_embedding_type="alibi"))


def test_moe_layers_follow_pattern_and_all_params_get_grads():
    pytest.importorskip("megamoe.moe.layer")
    from megamoe.moe.layer import MoELayer

    torch.manual_seed(0)
    c = tiny(num_layers=3, moe=moe_cfg(), moe_layer_pattern=[0, 1, 1], **LLAMA)
    model = GPTModel(c)
    kinds = [type(layer.mlp) for layer in model.decoder.layers]
    assert kinds == [MLP, MoELayer, MoELayer]
    tokens = _tokens()
    model(tokens, labels=tokens).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_moe_model_is_causal():
    pytest.importorskip("megamoe.moe.layer")
    torch.manual_seed(0)
    model = GPTModel(tiny(moe=moe_cfg(), **LLAMA)).eval()
    tokens = _tokens()
    base = model(tokens)
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 97
    torch.testing.assert_close(model(changed)[:, :7], base[:, :7], atol=1e-6, rtol=0)


def test_bf16_model_runs_and_loss_is_fp32():
    torch.manual_seed(0)
    c = tiny(**LLAMA)
    model = GPTModel(c)
    tokens, labels = _tokens(), _tokens(seed=1)
    ref = model(tokens, labels=labels)
    model = model.to(torch.bfloat16)
    loss = model(tokens, labels=labels)
    assert loss.dtype == torch.float32 and model(tokens).dtype == torch.bfloat16
    torch.testing.assert_close(loss.mean(), ref.mean(), atol=2e-2, rtol=2e-2)
    loss.mean().backward()
    assert all(p.grad is not None for p in model.parameters())
