"""moefy / upcycling: converted models reproduce the dense model's loss exactly."""

from __future__ import annotations

import copy
import shlex

import pytest
import torch
from torch import nn

import megamoe
from megamoe.config import ModelConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.moe.losses import MoELossTracker
from megamoe.moe.router import TopKRouter


@pytest.fixture(autouse=True)
def _reset():
    MoELossTracker.clear()
    yield
    MoELossTracker.clear()


def _dense(bias: bool, swiglu: bool) -> GPTModel:
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                      seq_length=8, max_position_embeddings=8, vocab_size=50,
                      hidden_dropout=0.0, attention_dropout=0.0, swiglu=swiglu,
                      add_bias_linear=bias, normalization="RMSNorm",
                      position_embedding_type="rope")
    return GPTModel(cfg)


def _loss(model, tokens):
    return model(tokens[:, :-1], labels=tokens[:, 1:]).mean()


@pytest.mark.parametrize("bias,swiglu", [(False, True), (True, False)])
def test_moefy_gpt_upcycled_loss_equals_dense(bias, swiglu):
    dense = _dense(bias, swiglu)
    tokens = torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    want = _loss(dense, tokens)
    moe = megamoe.moefy(copy.deepcopy(dense), num_experts=4, topk=2,
                        aux_loss_coeffs=[0.01])
    layers = [m for m in moe.modules() if isinstance(m, megamoe.MoELayer)]
    assert len(layers) == 2 and moe.config.moe.num_experts == 4
    assert moe.config.moe_layer_pattern == [1, 1]
    with torch.no_grad():  # make routing non-trivial: experts still agree
        for r in moe.modules():
            if isinstance(r, TopKRouter):
                r.weight.normal_(0.0, 1.0)
    got = _loss(moe, tokens)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    got.backward()  # trains: router and experts get gradients
    assert layers[0].experts.fc1_weight.grad.abs().sum() > 0
    # without upcycling, experts are freshly initialised and the loss differs
    fresh = megamoe.moefy(copy.deepcopy(dense), num_experts=4, topk=2, upcycle=False)
    with torch.no_grad():
        assert abs(float(_loss(fresh, tokens)) - float(want)) > 1e-4


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.ffn = nn.Sequential(nn.Linear(16, 40), nn.GELU(), nn.Linear(40, 16))

    def forward(self, x):
        return x + self.ffn(self.attn(x))


def test_moefy_any_model_with_predicate():
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    x = torch.randn(4, 5, 16)
    want = model(x)
    moe = megamoe.moefy(copy.deepcopy(model), num_experts=3, topk=2,
                        predicate=lambda name, m: name.endswith("ffn"))
    assert isinstance(moe[0].ffn, megamoe.MoELayer) and isinstance(moe[1].ffn,
                                                                   megamoe.MoELayer)
    torch.testing.assert_close(moe(x), want, atol=1e-6, rtol=1e-6)
    # a user factory decides the replacement
    built = []

    def factory(name, module, index):
        built.append((name, index))
        return megamoe.MoELayer(hidden_size=16, num_experts=2, topk=1, ffn_hidden_size=8,
                                layer_number=index, num_layers=2)

    megamoe.moefy(model, num_experts=2, predicate=lambda n, m: n.endswith("ffn"),
                  factory=factory)
    assert built == [("0.ffn", 0), ("1.ffn", 1)]
    assert model(x).shape == x.shape
    with pytest.raises(ValueError, match="no module matched"):
        megamoe.moefy(nn.Linear(2, 2), num_experts=2)


def test_pretrain_moe_use_upcycling_first_loss_equals_dense():
    from megamoe.cli.arguments import parse_args
    from megamoe.cli.main import pretrain

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --normalization RMSNorm --position-embedding-type "
            "rope --swiglu --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0 "
            "--ffn-hidden-size 48 --mock-data --tokenizer-type NullTokenizer --vocab-size 97 "
            "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1 "
            "--eval-iters 0 --seed 7 --train-iters 2")
    moe = "--num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-use-upcycling"

    def run(extra):
        args = parse_args(shlex.split(f"{base} {extra}"), world_size=1)
        return pretrain(args, print_fn=lambda _m: None).history

    dense, upcycled = run(""), run(moe)
    assert upcycled[0]["lm loss"] == pytest.approx(dense[0]["lm loss"], abs=1e-6)
    assert upcycled[1]["lm loss"] != dense[1]["lm loss"]  # then the models diverge
