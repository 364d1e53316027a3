"""tools/checkpoint/convert.py: transformers Mixtral <-> megamoe, logits and bits.

Weights are random with std 0.2 (norm gains 1 +- 0.2), so logits are O(1) and any layout
slip (gate/up swapped, experts permuted, q/k/v mixed) moves them far past the 1e-4
tolerance; `test_layout_slips_are_caught` proves that sensitivity (Megatron #909).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import megamoe
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.checkpoint import read_checkpoint, write_checkpoint
from tools.checkpoint.convert import main as convert

transformers = pytest.importorskip("transformers")
from tests.model.test_hf_parity import randomize_hf_weights  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 98  # NullTokenizer --vocab-size 97 (+ eod)


def hf_mixtral(path, *, hidden=32, heads=4, kv=2, experts=4, topk=2, ffn=48, layers=2,
               tied=False, seed=0):
    """A random tiny MixtralForCausalLM written with save_pretrained; returns the model."""
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, num_local_experts=experts,
        num_experts_per_tok=topk, max_position_embeddings=64, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.MixtralForCausalLM(cfg)
    randomize_hf_weights(model)
    model.save_pretrained(str(path))
    return model.eval()


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def _ours_logits(ckpt, tokens) -> torch.Tensor:
    with torch.no_grad():
        return megamoe.from_checkpoint(str(ckpt))(tokens)


CONFIGS = {  # (heads, kv heads, experts, topk, tied)
    "mha-e4-top2": dict(heads=4, kv=4, experts=4, topk=2),
    "gqa2-e8-top2": dict(heads=4, kv=2, experts=8, topk=2),
    "gqa4-e4-top1-tied": dict(heads=8, kv=2, experts=4, topk=1, tied=True),
    "mqa-e8-top1": dict(heads=4, kv=1, experts=8, topk=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_to_megamoe_matches_transformers_logits(tmp_path, name):
    hf = hf_mixtral(tmp_path / "hf", **CONFIGS[name])
    on_disk = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in on_disk  # per-expert
    assert convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"),
                    "--output", str(tmp_path / "mm")]) == 0
    tokens = _tokens()
    got, want = _ours_logits(tmp_path / "mm", tokens), _hf_logits(hf, tokens)
    assert got.shape == want.shape == (2, 12, VOCAB)
    assert (got - want).abs().max().item() <= 1e-4
    assert want.std().item() > 0.5  # logits are O(1): a 1e-4 match is meaningful


def test_fused_expert_layout_is_accepted(tmp_path):
    """transformers 5.x in-memory names (mlp.experts.gate_up_proj / down_proj, mlp.gate)."""
    hf = hf_mixtral(tmp_path / "hf")
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    os.remove(tmp_path / "hf" / "model.safetensors")
    save_file(fused, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"),
                    "--output", str(tmp_path / "mm")]) == 0
    tokens = _tokens()
    assert (_ours_logits(tmp_path / "mm", tokens) - _hf_logits(hf, tokens)).abs().max() <= 1e-4


def _swap_gate_up(sd, e):
    fc1 = sd["decoder.layers.0.mlp.experts.fc1_weight"]
    g, u = fc1[e].chunk(2, dim=1)
    fc1[e] = torch.cat([u, g], dim=1)


def _swap_experts(sd, e):
    for k in ("fc1_weight", "fc2_weight"):
        w = sd[f"decoder.layers.0.mlp.experts.{k}"]
        w[[e, e + 1]] = w[[e + 1, e]]


def _transpose_square_down(sd, e):
    w = sd["decoder.layers.0.mlp.experts.fc2_weight"]  # [E, F, H] with F == H here
    w[e] = w[e].t().clone()


@pytest.mark.parametrize("slip", [_swap_gate_up, _swap_experts, _transpose_square_down])
def test_layout_slips_are_caught(tmp_path, slip):
    """Each Megatron #909-style mistake moves the logits by >> 1e-4 (so the parity tests
    above would fail on it). F == H so that a transposed expert still has the right shape."""
    hf = hf_mixtral(tmp_path / "hf", ffn=32)
    convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mm")])
    state = read_checkpoint(str(tmp_path / "mm"))
    state.pop("_file")
    slip(state["model"], 0)
    write_checkpoint(str(tmp_path / "bad"), 0, state)
    tokens = _tokens()
    assert (_ours_logits(tmp_path / "bad", tokens) - _hf_logits(hf, tokens)).abs().max() > 1e-2


def test_megamoe_to_hf_to_megamoe_is_bit_exact(tmp_path):
    hf = hf_mixtral(tmp_path / "hf", experts=8, tied=False)
    convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "a")])
    assert convert(["megamoe-to-hf", "--input", str(tmp_path / "a"),
                    "--output", str(tmp_path / "hf2")]) == 0
    assert convert(["hf-to-megamoe", "--input", str(tmp_path / "hf2"),
                    "--output", str(tmp_path / "b")]) == 0
    a, b = read_checkpoint(str(tmp_path / "a")), read_checkpoint(str(tmp_path / "b"))
    assert a["model_config"] == b["model_config"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    # and the HF files themselves are identical to what transformers wrote
    orig = load_file(str(tmp_path / "hf" / "model.safetensors"))
    again = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert orig.keys() == again.keys()
    assert all(torch.equal(orig[k], again[k]) for k in orig)
    tokens = _tokens()
    back = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    assert torch.equal(_hf_logits(back, tokens), _hf_logits(hf, tokens))


def test_sharded_export_reads_back(tmp_path):
    from tools.checkpoint.convert import megamoe_to_hf_checkpoint

    hf = hf_mixtral(tmp_path / "hf")
    convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "a")])
    megamoe_to_hf_checkpoint(str(tmp_path / "a"), str(tmp_path / "hf2"), shard_bytes=40_000)
    index = json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    tokens = _tokens()
    assert torch.equal(_hf_logits(back, tokens), _hf_logits(hf, tokens))
    convert(["hf-to-megamoe", "--input", str(tmp_path / "hf2"), "--output", str(tmp_path / "b")])
    assert (_ours_logits(tmp_path / "b", tokens) - _hf_logits(hf, tokens)).abs().max() <= 1e-4


TINY = (
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 48 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --seq-length 16 "
    "--max-position-embeddings 64 --normalization RMSNorm --position-embedding-type rope "
    "--rotary-base 10000 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --num-experts 4 --moe-router-topk 2 "
    "--moe-ffn-hidden-size 48 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 97 --num-workers 0 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1 "
    "--eval-interval 1000 --eval-iters 0 --seed 3"
)


def _train(extra: str) -> list[dict]:
    args = parse_args(shlex.split(f"{TINY} {extra}"), world_size=1)
    return pretrain(args, print_fn=lambda _m: None).history


def test_export_of_a_training_run_loads_in_transformers(tmp_path):
    _train(f"--train-iters 3 --save {tmp_path / 'run'}")
    assert convert(["megamoe-to-hf", "--input", str(tmp_path / "run"),
                    "--output", str(tmp_path / "hf")]) == 0
    hf = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ours = megamoe.from_checkpoint(str(tmp_path / "run"))
    tokens = _tokens(1)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_converted_checkpoint_feeds_pretrain_load_and_finetune(tmp_path):
    hf_mixtral(tmp_path / "hf", ffn=48)
    convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mm")])
    # lr 0: one step must leave exactly the converted weights (proves they were loaded)
    _train(f"--train-iters 1 --lr 0 --load {tmp_path / 'mm'} --save {tmp_path / 'same'}")
    a, b = read_checkpoint(str(tmp_path / "mm")), read_checkpoint(str(tmp_path / "same"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    loaded = _train(f"--train-iters 3 --load {tmp_path / 'mm'}")
    finetuned = _train(f"--train-iters 3 --load {tmp_path / 'mm'} --finetune")
    scratch = _train("--train-iters 3")
    assert [h["iteration"] for h in loaded] == [1, 2, 3]
    assert [h["lm loss"] for h in loaded] == [h["lm loss"] for h in finetuned]
    assert loaded[0]["lm loss"] != scratch[0]["lm loss"]
    assert all(torch.isfinite(torch.tensor(h["lm loss"])) for h in loaded)  # training goes on


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint",
                                                        "convert.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def _one_line_error(p, *needles: str) -> None:
    """`p`: a CompletedProcess, or (returncode, stderr) of an in-process main()."""
    code, err = (p.returncode, p.stderr) if hasattr(p, "returncode") else p
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


def _in_process(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = convert(list(args))
    return code, capsys.readouterr().err


def _break_config(d, **change):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    hf_mixtral(tmp_path / "hf")
    out = tmp_path / "out"
    cases = []
    cases.append((("hf-to-megamoe", "--input", str(tmp_path / "nope")), ["nope"]))
    truncated = tmp_path / "trunc"
    os.makedirs(truncated)
    (truncated / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    data = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases.append((("hf-to-megamoe", "--input", str(truncated)), ["model.safetensors"]))
    experts = tmp_path / "experts"
    os.makedirs(experts)
    for f in ("config.json", "model.safetensors"):
        (experts / f).write_bytes((tmp_path / "hf" / f).read_bytes())
    _break_config(experts, num_local_experts=8)
    cases.append((("hf-to-megamoe", "--input", str(experts)), ["experts.4"]))
    shape = tmp_path / "shape"
    os.makedirs(shape)
    for f in ("config.json", "model.safetensors"):
        (shape / f).write_bytes((tmp_path / "hf" / f).read_bytes())
    _break_config(shape, intermediate_size=64)
    cases.append((("hf-to-megamoe", "--input", str(shape)), ["shape"]))
    llama = tmp_path / "llama"
    os.makedirs(llama)
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cases.append((("hf-to-megamoe", "--input", str(llama)), ["config.json", "llama"]))
    cases.append((("hf-to-megamoe", "--input", str(tmp_path / "hf"),
                   "--target-expert-parallel-size", "2", "--ckpt-format", "torch"),
                  ["--target-expert-parallel-size 2 needs --ckpt-format torch_dist"]))
    cases.append((("megamoe-to-hf", "--input", str(tmp_path / "hf")), ["latest_checkpointed"]))
    for args, needles in cases:
        _one_line_error(_in_process(capsys, *args, "--output", str(out)), *needles)
        assert not out.exists()
    # the real command line: same one line, exit 1, no traceback
    _one_line_error(_cli(*cases[1][0], "--output", str(out)), *cases[1][1])
    assert not out.exists()


def test_megamoe_to_hf_bad_input(tmp_path, capsys):
    hf_mixtral(tmp_path / "hf")
    convert(["hf-to-megamoe", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mm")])
    pt = tmp_path / "mm" / "iter_0000000" / "__0_0.distcp"
    pt.write_bytes(pt.read_bytes()[:1000])
    out = tmp_path / "out"
    _one_line_error(_in_process(capsys, "megamoe-to-hf", "--input", str(tmp_path / "mm"),
                                "--output", str(out)), "iter_0000000", "cannot be read")
    assert not out.exists()
    # existing output is never overwritten
    p = _in_process(capsys, "hf-to-megamoe", "--input", str(tmp_path / "hf"),
                    "--output", str(tmp_path / "mm"))
    _one_line_error(p, "already holds a checkpoint")
    assert len(pt.read_bytes()) == 1000


def test_megamoe_to_hf_without_transformers_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    out = tmp_path / "out"
    _one_line_error(_in_process(capsys, "megamoe-to-hf", "--input", str(tmp_path),
                                "--output", str(out)),
                    "needs transformers", "pip install -e .[hf]")
    assert not out.exists()
