"""tools/checkpoint/convert.py for Qwen3-MoE, Qwen2-MoE and OLMoE (Mixtral: test_convert.py):
random tiny models of each family with every feature on (q/k norms of either scope, QKV
bias, a gated shared expert, dense layers mixed in, top-3 routing, norm_topk_prob both
ways, a vocabulary of 98, a head_dim apart from hidden / heads), converted on disk both
ways: megamoe's logits within 1e-4 of transformers (fp32), the exported folder loads in
transformers with identical logits, and HF -> megamoe -> HF is bit exact."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from safetensors.torch import load_file

import megamoe
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.checkpoint import read_checkpoint
from tools.checkpoint.convert import hf_model_flags
from tools.checkpoint.convert import main as convert

transformers = pytest.importorskip("transformers")
from tests.model.test_hf_parity import randomize_hf_weights  # noqa: E402

VOCAB = 98  # NullTokenizer --vocab-size 98 (EOD 97): not a multiple of 128
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=3, initializer_range=0.02,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
QWEN = dict(COMMON, num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=24,
            num_experts=8, rms_norm_eps=1e-6)
CASES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(QWEN, head_dim=16, mlp_only_layers=[0],
                                              norm_topk_prob=True)),
    "qwen3_moe-nonorm-tied": ("Qwen3MoeForCausalLM", dict(
        QWEN, decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(QWEN, shared_expert_intermediate_size=36,
                                              mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen2_moe-norm": ("Qwen2MoeForCausalLM", dict(
        QWEN, shared_expert_intermediate_size=20, decoder_sparse_step=2, norm_topk_prob=True)),
    "olmoe": ("OlmoeForCausalLM", dict(COMMON, num_hidden_layers=2, intermediate_size=24,
                                       num_experts=8, norm_topk_prob=False)),
    "olmoe-norm": ("OlmoeForCausalLM", dict(COMMON, num_hidden_layers=2, intermediate_size=24,
                                            num_experts=6, norm_topk_prob=True)),
}


def hf_model(path, name: str, seed: int = 0):
    """A random tiny model of CASES[name] written with save_pretrained (fp32, eval)."""
    arch, kw = CASES[name]
    torch.manual_seed(seed)
    cls = getattr(transformers, arch)
    model = cls(cls.config_class(**kw))
    randomize_hf_weights(model)
    model.save_pretrained(str(path))
    return model.eval()


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def _diff(ckpt, hf, tokens) -> float:
    with torch.no_grad():
        got, want = megamoe.from_checkpoint(str(ckpt))(tokens), hf(tokens).logits
    assert got.shape == want.shape == (*tokens.shape, VOCAB)
    assert want.std().item() > 0.5  # logits are O(1): a 1e-4 match is meaningful
    return (got - want).abs().max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_family_converts_both_ways_with_transformers_logits(tmp_path, name):
    hf = hf_model(tmp_path / "hf", name)
    assert convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"),
                    "--output", str(tmp_path / "a")]) == 0
    tokens = _tokens()
    diff = _diff(tmp_path / "a", hf, tokens)
    print(f"{name}: max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4
    assert convert(["megamoe-to-hf", "--input", str(tmp_path / "a"),
                    "--output", str(tmp_path / "hf2")]) == 0
    cfg = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert cfg["architectures"] == [CASES[name][0]]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)
    orig = load_file(str(tmp_path / "hf" / "model.safetensors"))
    again = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert orig.keys() == again.keys()
    assert all(torch.equal(orig[k], again[k]) for k in orig)
    assert convert(["hf-to-megamoe", "--input", str(tmp_path / "hf2"),
                    "--output", str(tmp_path / "b")]) == 0
    a, b = read_checkpoint(str(tmp_path / "a")), read_checkpoint(str(tmp_path / "b"))
    assert a["model_config"] == b["model_config"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_fused_in_memory_layout_converts(tmp_path):
    """transformers 5.x in-memory names (mlp.experts.gate_up_proj / down_proj)."""
    from safetensors.torch import save_file

    hf = hf_model(tmp_path / "hf", "qwen2_moe")
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    save_file(fused, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"),
                    "--output", str(tmp_path / "mm")]) == 0
    assert _diff(tmp_path / "mm", hf, _tokens()) <= 1e-4


@pytest.mark.parametrize("name, change, needle", [
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "sliding_window"),
    ("qwen3_moe", dict(model_type="qwen9_moe", architectures=["Qwen9MoeForCausalLM"]),
     "qwen9_moe"),
])
def test_unsupported_config_is_one_line(tmp_path, capsys, name, change, needle):
    hf_model(tmp_path / "hf", name)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    code = convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"),
                    "--output", str(tmp_path / "mm")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "mm").exists()


def test_unmapped_weight_is_an_error(tmp_path, capsys):
    from safetensors.torch import save_file

    hf_model(tmp_path / "hf", "qwen3_moe")
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"),
                    "--output", str(tmp_path / "mm")]) == 1
    assert "self_attn.extra.weight" in capsys.readouterr().err


TRAIN = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 98 --num-workers 0 "
         "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1 "
         "--eval-interval 1000 --eval-iters 0 --seed 3 --seq-length 16")


def test_converted_qwen3_moe_loads_and_trains_one_step(tmp_path):
    hf_model(tmp_path / "hf", "qwen3_moe")
    convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mm")])
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    flags = shlex.join(hf_model_flags(cfg)).replace("--seq-length 64", "")

    def train(extra: str) -> list[dict]:
        args = parse_args(shlex.split(f"{flags} {TRAIN} {extra}"), world_size=1)
        return pretrain(args, print_fn=lambda _m: None).history

    # lr 0: the step leaves exactly the converted weights (they were loaded)
    train(f"--train-iters 1 --lr 0 --load {tmp_path / 'mm'} --save {tmp_path / 'same'}")
    a, b = read_checkpoint(str(tmp_path / "mm")), read_checkpoint(str(tmp_path / "same"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    loaded = train(f"--train-iters 1 --load {tmp_path / 'mm'}")
    scratch = train("--train-iters 1")
    assert len(loaded) == 1 and torch.isfinite(torch.tensor(loaded[0]["lm loss"]))
    assert loaded[0]["lm loss"] != scratch[0]["lm loss"]
