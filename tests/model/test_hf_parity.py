"""Logit parity with Hugging Face MixtralForCausalLM / LlamaForCausalLM (fp32)."""

from __future__ import annotations

import pytest
import torch

from megamoe.config import ModelConfig, MoEConfig
from megamoe.model import GPTModel
from megamoe.model.hf_mapping import hf_to_megamoe
from megamoe.moe.experts import use_grouped_gemm

transformers = pytest.importorskip("transformers")

H, LAYERS, HEADS, KV, FFN, VOCAB = 64, 2, 4, 2, 96, 128


def _ours(moe: bool) -> ModelConfig:
    return ModelConfig(
        num_layers=LAYERS, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=KV, seq_length=16, max_position_embeddings=64, vocab_size=VOCAB,
        make_vocab_size_divisible_by=1, normalization="RMSNorm", norm_epsilon=1e-5,
        position_embedding_type="rope", rotary_base=10000.0, swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
        attention_dropout=0.0,
        moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=FFN) if moe else None)


def _hf_common() -> dict:
    return dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV, intermediate_size=FFN, vocab_size=VOCAB,
                rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                max_position_embeddings=64)


def randomize_hf_weights(model) -> None:
    """HF ones-inits norms and uses small stds; make every weight distinctive and the logits
    O(1), so a mapping mistake (say gate/up swapped) moves them far beyond the tolerance."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)


def _check_parity(hf_model, config: ModelConfig, state_dict=None, grouped_gemm=False):
    hf_model = hf_model.float().eval()
    torch.manual_seed(1)
    ours = GPTModel(config).eval()
    use_grouped_gemm(ours, grouped_gemm)
    ours.load_state_dict(hf_to_megamoe(state_dict or hf_model.state_dict(), config),
                         strict=True)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_model(tokens).logits
        got = ours(tokens)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    return ours, tokens


def _mixtral():
    pytest.importorskip("megamoe.moe.layer")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                     **_hf_common())
    model = transformers.MixtralForCausalLM(cfg)
    randomize_hf_weights(model)
    return model


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_mixtral_logits_match(grouped_gemm):
    _check_parity(_mixtral(), _ours(moe=True), grouped_gemm=grouped_gemm)


def test_mixtral_on_disk_expert_layout_matches():
    """Per-expert w1/w2/w3 keys (safetensors layout) map to the same model."""
    hf = _mixtral()
    sd = {}
    for k, v in hf.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            prefix = k[: -len(".mlp.experts.gate_up_proj")] + ".block_sparse_moe"
            for e in range(v.shape[0]):
                w1, w3 = v[e].chunk(2, dim=0)
                sd[f"{prefix}.experts.{e}.w1.weight"] = w1
                sd[f"{prefix}.experts.{e}.w3.weight"] = w3
        elif k.endswith("experts.down_proj"):
            prefix = k[: -len(".mlp.experts.down_proj")] + ".block_sparse_moe"
            for e in range(v.shape[0]):
                sd[f"{prefix}.experts.{e}.w2.weight"] = v[e]
        elif ".mlp.gate." in k:
            sd[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = v
        else:
            sd[k] = v
    _check_parity(hf, _ours(moe=True), sd)


def test_llama_dense_logits_match():
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_hf_common()))
    randomize_hf_weights(hf)
    ours, tokens = _check_parity(hf, _ours(moe=False))
    # Same per-token loss as HF's own (mean) causal-LM loss on shifted labels.
    labels = tokens.roll(-1, dims=1)
    with torch.no_grad():
        hf_loss = hf(tokens, labels=tokens).loss
        our_loss = ours(tokens, labels=labels)[:, :-1].mean()
    torch.testing.assert_close(our_loss, hf_loss, atol=1e-5, rtol=1e-5)


def test_unmapped_keys_are_errors():
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_hf_common()))
    sd = dict(hf.state_dict())
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="unmapped"):
        hf_to_megamoe(sd, _ours(moe=False))
