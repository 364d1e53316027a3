"""Megatron's fused bias-GELU (megatron/core/fusions/fused_bias_gelu.py, run by
transformer/mlp.py whenever bias_activation_fusion is on for F.gelu) is the tanh
approximation of GELU; without biases or with --no-bias-gelu-fusion it is exact erf GELU.
Checked here against Megatron's formula and hand-written gradient, written out, on the
activation, the flag -> activation mapping and a whole MoE model (dense MLP, shared and
routed experts)."""

from __future__ import annotations

import shlex

import pytest
import torch
import torch.nn.functional as F

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import ModelConfig, MoEConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.moe import activations
from megamoe.moe.activations import apply_activation


def megatron_bias_gelu(bias, y):
    """fused_bias_gelu.bias_gelu, verbatim."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def megatron_bias_gelu_back(g, bias, y):
    """fused_bias_gelu.bias_gelu_back, verbatim (Megatron's own backward)."""
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (
        1 + tanh_out)
    return ff * g


@pytest.mark.parametrize("dtype, atol, grad_atol", [
    # fp32: the same formula in a different operation order (a few ulps); Megatron's fp32
    # backward computes 1 - tanh^2 where tanh rounds to -1 (x < -5), losing ~1e-6 there;
    # fp64: Megatron's constants are rounded to 8-10 digits (sqrt(2/pi) = 0.7978845608...),
    # which moves the values by ~1e-9, far below erf GELU's distance (~5e-4)
    (torch.float32, 2e-6, 1e-5), (torch.float64, 1e-8, 1e-8)])
def test_torch_tanh_gelu_is_megatrons_bias_gelu(dtype, atol, grad_atol):
    torch.manual_seed(0)
    y = torch.cat([torch.linspace(-8, 8, 4001, dtype=dtype), 3 * torch.randn(4000, dtype=dtype)])
    bias = torch.randn(y.shape, dtype=dtype)
    x = (bias + y).requires_grad_(True)
    out = apply_activation("gelu_tanh", x)
    torch.testing.assert_close(out, megatron_bias_gelu(bias, y), rtol=0, atol=atol)
    g = torch.randn_like(y)
    (grad,) = torch.autograd.grad(out, x, g)
    torch.testing.assert_close(grad, megatron_bias_gelu_back(g, bias, y), rtol=0,
                               atol=grad_atol)
    # the comparison can tell the two GELUs apart
    assert (F.gelu(x) - megatron_bias_gelu(bias, y)).abs().max() > 100 * atol


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 1 --lr 1e-3 --mock-data")


@pytest.mark.parametrize("extra, activation", [
    ("", "gelu_tanh"),  # biases (Megatron's default) and the fusion on: bias_gelu_impl
    ("--no-bias-gelu-fusion", "gelu"),
    ("--disable-bias-linear", "gelu"),  # validate_args: no bias, no fusion
    ("--disable-bias-linear --no-bias-gelu-fusion", "gelu"),
    ("--swiglu", "swiglu"), ("--swiglu --no-bias-gelu-fusion", "swiglu"),
    ("--squared-relu --no-bias-gelu-fusion", "squared_relu")])
def test_flags_choose_megatrons_gelu(extra, activation):
    args = parse_args(shlex.split(f"{BASE} {extra}"))
    assert run_config_from_args(args, 97).model.activation == activation


def _moe_model(**kw) -> GPTModel:
    """Layer 0 dense, layer 1 MoE with shared experts: every module with an activation."""
    torch.manual_seed(4)
    cfg = ModelConfig(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=2,
                      vocab_size=53, seq_length=8, max_position_embeddings=8,
                      hidden_dropout=0.0, attention_dropout=0.0, moe_layer_pattern=[0, 1],
                      init_method_std=0.4,
                      moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=12,
                                    shared_expert_intermediate_size=20, router_dtype="fp64"),
                      **kw)
    model = GPTModel(cfg).double()
    with torch.no_grad():  # biases start at zero: make them count
        for name, p in model.named_parameters():
            if "bias" in name and "norm" not in name:
                p.normal_(0.0, 0.5)
    return model


def test_model_default_runs_megatrons_tanh_gelu_and_the_flag_changes_the_loss(monkeypatch):
    """The default biased GELU model's loss and gradients equal the same model with every
    activation computed by Megatron's bias_gelu written out; --no-bias-gelu-fusion (erf)
    gives another loss."""
    tokens = torch.randint(0, 53, (2, 8), generator=torch.Generator().manual_seed(5))
    model = _moe_model()
    assert model.decoder.layers[0].mlp.activation == "gelu_tanh"
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    calls = []

    def written_out(x):
        calls.append(x.shape)
        return megatron_bias_gelu(torch.zeros_like(x), x)

    monkeypatch.setitem(activations._ELEMENTWISE, "gelu_tanh", written_out)
    model.zero_grad()
    ref = model(tokens, labels=tokens).mean()
    ref.backward()
    assert len(calls) >= 3  # dense MLP, shared experts, routed experts
    # the loss comes out in fp32; Megatron's rounded constants move it ~1e-9 (fp64 model)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    monkeypatch.undo()
    erf = _moe_model(bias_gelu_fusion=False)
    erf.load_state_dict(model.state_dict())
    # erf moves this loss by ~2e-5 (20x the tolerance above)
    assert (erf(tokens, labels=tokens).mean() - loss).abs() > 1e-6


def test_checkpoints_keep_loading_and_megatron_args_say_which_gelu():
    """The GELU form changes no parameter: a checkpoint config without the field (written
    before it) or with the other value passes the load's shape check (the run's flags
    decide, docs/checkpoints-and-conversion.md#format-changes). Written as a Megatron-LM
    run, the saved args carry bias_gelu_fusion as Megatron's validate_args leaves it."""
    from megamoe.cli.megatron_args import megatron_namespace
    from megamoe.training.checkpoint.config_check import check_model_config

    run = ModelConfig(num_attention_heads=4, vocab_size=64)
    old = {k: v for k, v in vars(run).items() if k not in ("bias_gelu_fusion", "moe")}
    check_model_config("ckpt", old, run)
    check_model_config("ckpt", dict(old, bias_gelu_fusion=False), run)
    for kw, want in (({}, True), ({"bias_gelu_fusion": False}, False),
                     ({"add_bias_linear": False}, False)):
        ns = megatron_namespace({}, ModelConfig(num_attention_heads=4, vocab_size=64, **kw),
                                iteration=1, consumed_samples=0, padded_vocab=128)
        assert ns.bias_gelu_fusion is want, kw


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_routed_experts_run_megatrons_bias_gelu(grouped):
    """GroupedExperts with the model's gelu_tanh, per expert against Megatron's bias_gelu
    written out (fc1's bias as its `bias`), times the combine weight; Megatron's
    SequentialMLP computes this, its TEGroupedMLP refuses it (docs/megatron-compatibility.md)."""
    from megamoe.moe.experts import GroupedExperts

    torch.manual_seed(6)
    experts = GroupedExperts(3, 8, 6, swiglu=False, add_bias=True, init_method_std=0.5,
                             output_init_std=0.5, grouped_gemm=grouped,
                             activation=ModelConfig().activation).double()
    with torch.no_grad():
        experts.fc1_bias.normal_()
        experts.fc2_bias.normal_()
    sizes = torch.tensor([4, 0, 6])
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    p = torch.rand(10, dtype=torch.float64)
    got = experts(x, sizes, p)
    rows, start = [], 0
    for e, n in enumerate(sizes.tolist()):
        y = x[start:start + n] @ experts.fc1_weight[e]
        a = megatron_bias_gelu(experts.fc1_bias[e], y)
        rows.append((a @ experts.fc2_weight[e] + experts.fc2_bias[e]) * p[start:start + n, None])
        start += n
    ref = torch.cat(rows)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-8)  # Megatron's 8-digit constants
    g = torch.randn_like(ref)
    params = [x, experts.fc1_weight, experts.fc1_bias, experts.fc2_weight]
    for a, b in zip(torch.autograd.grad(got, params, g, retain_graph=True),
                    torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-8)
