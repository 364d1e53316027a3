"""tools/checkpoint/convert.py for DeepSeek-V3 (DeepseekV3ForCausalLM): random tiny models
with every feature on (multi-latent attention with and without q compression, YaRN with
mscale, dense first layers, sigmoid routing limited to groups with a non-zero correction
bias, scaled, shared experts, top-4 of 8, a vocabulary of 98), converted on disk both
ways: megamoe's logits within 1e-4 of transformers (fp32), the exported folder loads in
transformers with identical logits, HF -> megamoe -> HF is bit exact. MTP layers, which
transformers drops, are checked by a round trip of a file that has them and by the MTP
loss megamoe computes from the converted weights against a hand-written reference."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import megamoe
from megamoe.model.mtp import MTPLossTracker
from megamoe.training.checkpoint import read_checkpoint
from tools.checkpoint.convert import main as convert

transformers = pytest.importorskip("transformers")
from tests.model.test_hf_parity import randomize_hf_weights  # noqa: E402

VOCAB = 98
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1}
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
            num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=12,
            n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=4, n_group=4,
            topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
            kv_lora_rank=8, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=6, max_position_embeddings=64, rms_norm_eps=1e-6,
            initializer_range=0.02, rope_parameters=YARN)
CASES = {
    "q-lora-yarn": BASE,
    "no-q-lora-rope-tied": dict(BASE, q_lora_rank=None, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "default",
                                                 "rope_theta": 10000.0}),
}


def hf_model(path, name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CASES[name]))
    randomize_hf_weights(model)
    with torch.no_grad():  # a non-zero correction bias that changes the routing
        for name_, buf in model.named_buffers():
            if name_.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.5)
    model.save_pretrained(str(path))
    return model.eval()


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CASES))
def test_deepseek_v3_converts_both_ways_with_transformers_logits(tmp_path, name):
    hf = hf_model(tmp_path / "hf", name)
    assert convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"),
                    "--output", str(tmp_path / "a")]) == 0
    tokens = _tokens()
    with torch.no_grad():
        got, want = megamoe.from_checkpoint(str(tmp_path / "a"))(tokens), hf(tokens).logits
    assert want.std().item() > 0.5
    diff = (got - want).abs().max().item()
    print(f"deepseek_v3 {name}: max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4
    assert convert(["megamoe-to-hf", "--input", str(tmp_path / "a"),
                    "--output", str(tmp_path / "hf2")]) == 0
    cfg = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)
    orig = load_file(str(tmp_path / "hf" / "model.safetensors"))
    again = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert orig.keys() == again.keys()
    assert all(torch.equal(orig[k], again[k]) for k in orig)


def _with_mtp_layer(src, dst) -> dict:
    """The tiny model's folder plus one MTP depth stored as DeepSeek's files do
    (model.layers.{N}: enorm, hnorm, eh_proj, a MoE decoder layer, shared_head.norm, and
    copies of the embedding and output head)."""
    sd = load_file(str(src / "model.safetensors"))
    n = BASE["num_hidden_layers"]
    g = torch.Generator().manual_seed(5)
    for k in [k for k in sd if k.startswith(f"model.layers.{n - 1}.")]:
        sd[k.replace(f"layers.{n - 1}.", f"layers.{n}.")] = (
            sd[k] + 0.02 * torch.randn(sd[k].shape, generator=g))
    h = BASE["hidden_size"]
    mtp = f"model.layers.{n}"
    sd[f"{mtp}.enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    sd[f"{mtp}.hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    sd[f"{mtp}.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    sd[f"{mtp}.eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    sd[f"{mtp}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[f"{mtp}.shared_head.head.weight"] = sd["lm_head.weight"].clone()
    dst.mkdir()
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    return sd


def _reference_mtp_loss(hf, sd: dict, tokens: torch.Tensor, labels: torch.Tensor
                        ) -> torch.Tensor:
    """DeepSeek-V3's MTP depth 1 by hand from the HF tensors: h = the main model's last
    hidden state after its final norm; x = eh_proj(cat(enorm(emb(t[i+1])), hnorm(h_i)));
    one decoder layer (transformers' own, loaded with the MTP layer's tensors);
    shared_head.norm, the output head; cross-entropy against labels[i+1] (= t[i+2]), mean
    over the positions that have one."""
    n, cfg = BASE["num_hidden_layers"], hf.config
    mtp = f"model.layers.{n}"

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    with torch.no_grad():
        out = hf.model(tokens)
        h = out.last_hidden_state  # after model.norm
        layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(
            cfg, n - 1)  # an MoE layer
        mine = {k[len(mtp) + 1:]: v for k, v in sd.items()
                if k.startswith(mtp + ".") and k.split(".")[3] in
                ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}
        experts = range(BASE["n_routed_experts"])  # on disk per expert, in memory fused
        mine["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([
            mine.pop(f"mlp.experts.{e}.gate_proj.weight"),
            mine.pop(f"mlp.experts.{e}.up_proj.weight")]) for e in experts])
        mine["mlp.experts.down_proj"] = torch.stack([
            mine.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
        layer.load_state_dict(mine)
        layer.eval()
        s = tokens.shape[1] - 1
        emb = sd["model.embed_tokens.weight"][tokens[:, 1:]]
        x = torch.cat([rms(emb, sd[f"{mtp}.enorm.weight"]),
                       rms(h[:, :s], sd[f"{mtp}.hnorm.weight"])], -1) @ sd[
            f"{mtp}.eh_proj.weight"].t()
        pos = torch.arange(s)[None]
        x = layer(x, position_embeddings=hf.model.rotary_emb(x, pos), position_ids=pos,
                  attention_mask=torch.full((s, s), float("-inf")).triu(1)[None, None])
        x = x[0] if isinstance(x, tuple) else x
        logits = rms(x, sd[f"{mtp}.shared_head.norm.weight"]) @ sd["lm_head.weight"].t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def test_mtp_layers_round_trip_and_give_deepseeks_mtp_loss(tmp_path, capsys):
    hf = hf_model(tmp_path / "hf", "q-lora-yarn")
    sd = _with_mtp_layer(tmp_path / "hf", tmp_path / "mtp")
    assert convert(["hf-to-megamoe", "--input", str(tmp_path / "mtp"),
                    "--output", str(tmp_path / "a")]) == 0
    assert read_checkpoint(str(tmp_path / "a"))["model_config"]["mtp_num_layers"] == 1
    assert convert(["megamoe-to-hf", "--input", str(tmp_path / "a"),
                    "--output", str(tmp_path / "hf2")]) == 0
    again = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert sd.keys() == again.keys()
    assert all(torch.equal(sd[k], again[k]) for k in sd)
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 1
    # the export says, in one line, that transformers does not load the MTP layer, and it
    # does not: it reports the layer's weights as unexpected and builds no such module
    n = hf.config.num_hidden_layers
    note = [line for line in capsys.readouterr().out.splitlines() if "MTP" in line]
    assert len(note) == 1 and f"written as model.layers.{n} " in note[0], note
    loaded, info = type(hf).from_pretrained(str(tmp_path / "hf2"), output_loading_info=True)
    mtp = f"model.layers.{n}."
    assert {"eh_proj", "enorm", "hnorm"} <= {k[len(mtp):].split(".")[0]
                                             for k in info["unexpected_keys"]
                                             if k.startswith(mtp)}, info
    assert not any(k.startswith(mtp) for k in loaded.state_dict())
    model = megamoe.from_checkpoint(str(tmp_path / "a")).train()
    tokens = _tokens(3)
    MTPLossTracker.take()
    with torch.no_grad():
        model(tokens[:, :-1], labels=tokens[:, 1:])
    got = MTPLossTracker.take()[0]
    want = _reference_mtp_loss(hf, sd, tokens[:, :-1], tokens[:, 1:])
    assert abs(float(got) - float(want)) <= 1e-5 * float(want), (float(got), float(want))


@pytest.mark.parametrize("change, needle", [
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(num_experts_per_tok=3), "num_experts_per_tok != 2 x topk_group"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
])
def test_unsupported_deepseek_config_is_one_line(tmp_path, capsys, change, needle):
    hf_model(tmp_path / "hf", "q-lora-yarn")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **change}))
    capsys.readouterr()  # save_pretrained's progress bar
    assert convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"),
                    "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()
