"""--squared-relu, --quick-geglu and --rotary-interleaved against explicit formulas written
from Megatron-LM's source (megatron/core/activations.py, transformer/mlp.py's glu(),
rope_utils._rotate_half(rotary_interleaved=True) with RotaryEmbedding's [f0, f0, f1, f1, ...]
angles), forward and gradients, on the dense MLP, the shared experts, the routed experts
and a whole model."""

from __future__ import annotations

import math
import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import ModelConfig
from megamoe.model.gpt_model import GPTModel, rotary_for
from megamoe.model.mlp import MLP
from megamoe.model.rope import apply_rotary_pairs, llama3_scaled_inv_freq, rotary_cos_sin
from megamoe.moe.experts import GroupedExperts, SharedExpertMLP
from tests.flags import parse_error

H, F_, N = 8, 6, 10


def reference(name: str, h: torch.Tensor) -> torch.Tensor:
    """Each activation element by element, as Megatron writes it."""
    if name == "squared_relu":
        return torch.where(h > 0, h * h, torch.zeros_like(h))
    if name == "quick_geglu":
        gate, up = h[..., :F_], h[..., F_:]
        return gate / (1.0 + torch.exp(-1.702 * gate)) * up  # x * sigmoid(1.702 x) * up
    raise AssertionError(name)


def _mlp_ref(x, w1, b1, w2, b2, name):
    return reference(name, x @ w1.t() + b1) @ w2.t() + b2


@pytest.mark.parametrize("name", ["squared_relu", "quick_geglu"])
def test_dense_and_shared_mlp_match_megatrons_formula(name):
    """Forward and every gradient of the dense MLP and the shared experts against the
    formula; the gated one's fc1 is [gate; up], 2F rows."""
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=H, ffn_hidden_size=F_, num_attention_heads=2,
                      vocab_size=16, add_bias_linear=True, **{name: True})
    assert cfg.activation == name and cfg.gated_linear_unit == (name == "quick_geglu")
    fc1_rows = 2 * F_ if name == "quick_geglu" else F_
    for module in (MLP(cfg).double(),
                   SharedExpertMLP(H, F_, swiglu=False, add_bias=True, gate=False,
                                   init_method_std=0.5, output_init_std=0.5,
                                   activation=name).double()):
        fc1, fc2 = module.linear_fc1, module.linear_fc2
        assert fc1.weight.shape == (fc1_rows, H)
        with torch.no_grad():
            for p in (fc1.bias, fc2.bias):
                p.normal_()
        x = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
        got = module(x)
        params = [x, fc1.weight, fc1.bias, fc2.weight, fc2.bias]
        leaves = [p.detach().clone().requires_grad_(True) for p in params]
        ref = _mlp_ref(*leaves, name)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        g = torch.randn_like(ref)
        grads = torch.autograd.grad(got, params, g)
        ref_grads = torch.autograd.grad(ref, leaves, g)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["squared_relu", "quick_geglu"])
def test_routed_experts_match_a_per_expert_loop(name):
    """GroupedExperts (grouped GEMM and loop backends, combine weights folded in) against
    each expert's formula applied to its rows, times the row's weight."""
    torch.manual_seed(1)
    experts = GroupedExperts(3, H, F_, swiglu=False, add_bias=True, init_method_std=0.5,
                             output_init_std=0.5, grouped_gemm=True, activation=name).double()
    with torch.no_grad():
        experts.fc1_bias.normal_()
        experts.fc2_bias.normal_()
    sizes = torch.tensor([4, 0, 6])
    x = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    p = torch.rand(N, dtype=torch.float64, requires_grad=True)
    got = experts(x, sizes, p)
    rows, start = [], 0
    for e, n in enumerate(sizes.tolist()):
        xe = x[start:start + n]
        h = xe @ experts.fc1_weight[e] + experts.fc1_bias[e]
        y = reference(name, h) @ experts.fc2_weight[e] + experts.fc2_bias[e]
        rows.append(y * p[start:start + n, None])
        start += n
    ref = torch.cat(rows)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    params = [x, p, experts.fc1_weight, experts.fc1_bias, experts.fc2_weight]
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(got, params, g, retain_graph=True),
                    torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def naive_interleaved_rope(x_SBND: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """Channels (2j, 2j+1) as the complex number x_2j + i x_2j+1, times e^(i t f_j),
    f_j = base^(-2j/rot): GPT-J / Meta Llama's rotation (Megatron's rotary_interleaved)."""
    out = x_SBND.clone()
    for t in range(x_SBND.shape[0]):
        for j in range(rot // 2):
            theta = t * base ** (-2.0 * j / rot)
            c, s = math.cos(theta), math.sin(theta)
            a, b = x_SBND[t, ..., 2 * j], x_SBND[t, ..., 2 * j + 1]
            out[t, ..., 2 * j] = a * c - b * s
            out[t, ..., 2 * j + 1] = b * c + a * s
    return out


@pytest.mark.parametrize("rot", [8, 4])
def test_interleaved_rope_matches_the_complex_rotation(rot):
    """rot < D (--rotary-percent 0.5): the last channels pass through."""
    torch.manual_seed(2)
    x = torch.randn(5, 2, 3, 8, dtype=torch.float64)
    cos, sin = rotary_cos_sin(5, rot, 10000.0)
    got = apply_rotary_pairs(x, cos.double(), sin.double())
    # atol: the angles are computed in fp32 (as rotary_cos_sin always does), the reference
    # in double; a wrong pair order or angle is O(1) off
    torch.testing.assert_close(got, naive_interleaved_rope(x, rot, 10000.0), rtol=0, atol=1e-6)


def _deinterleave_qk_rows(w: torch.Tensor, heads: int, groups: int, d: int) -> torch.Tensor:
    """linear_qkv's q and k rows of each head reordered (0, 2, 4, .., 1, 3, ..): the
    rotate-half model with these weights computes the interleaved model's scores."""
    order = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    q, k, v = w.split([heads * d, groups * d, groups * d])
    perm = lambda t, n: t.view(n, d, -1)[:, order].reshape(n * d, -1)
    return torch.cat((perm(q, heads), perm(k, groups), v))


def test_model_with_rotary_interleaved_equals_rotate_half_on_permuted_weights():
    """The flag reaches every attention layer: the interleaved model's loss and gradients
    equal those of the rotate-half model whose q/k rows are de-interleaved per head (q.k
    is a sum over channels, so the common permutation cancels)."""
    torch.manual_seed(3)
    kw = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
              num_query_groups=2, vocab_size=97, seq_length=12, max_position_embeddings=12,
              position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
              swiglu=True, add_bias_linear=False)
    inter = GPTModel(ModelConfig(rotary_interleaved=True, **kw)).double()
    half = GPTModel(ModelConfig(**kw)).double()
    state = inter.state_dict()
    for key in state:
        if key.endswith("linear_qkv.weight"):
            state[key] = _deinterleave_qk_rows(state[key], 4, 2, 8)
    half.load_state_dict(state)
    tokens = torch.randint(0, 97, (2, 12))
    loss_i = inter(tokens, labels=tokens).mean()
    loss_h = half(tokens, labels=tokens).mean()
    torch.testing.assert_close(loss_i, loss_h, rtol=1e-12, atol=1e-12)
    loss_i.backward()
    loss_h.backward()
    for (name, a), (_, b) in zip(inter.named_parameters(), half.named_parameters()):
        if name.endswith("linear_qkv.weight"):
            a = _deinterleave_qk_rows(a.grad, 4, 2, 8)
        else:
            a = a.grad
        torch.testing.assert_close(a, b.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert (inter(tokens, labels=tokens) - half(tokens, labels=tokens)).abs().max() < 1e-9
    plain = GPTModel(ModelConfig(**kw)).double()
    plain.load_state_dict(inter.state_dict())  # same weights, halves: a different model
    assert (plain(tokens, labels=tokens).mean() - loss_i).abs() > 1e-6


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 1 --lr 1e-3 --mock-data")


def test_flags_reach_the_model_and_megatrons_sizes():
    """--quick-geglu keeps the 4 x hidden --ffn-hidden-size default (only --swiglu takes
    8/3); --openai-gelu changes nothing (Megatron-LM reads it nowhere)."""
    model = lambda extra: run_config_from_args(parse_args(shlex.split(f"{BASE} {extra}")),
                                               97).model
    assert model("--quick-geglu").ffn_hidden_size == 256
    assert model("--quick-geglu").activation == "quick_geglu"
    assert model("--squared-relu").activation == "squared_relu"
    assert model("--openai-gelu") == model("")
    assert model("--position-embedding-type rope --rotary-interleaved").rotary_interleaved


@pytest.mark.parametrize("extra, words", [
    ("--swiglu --squared-relu", "--swiglu and --squared-relu cannot be combined"),
    ("--swiglu --quick-geglu", "--swiglu and --quick-geglu cannot be combined"),
    ("--squared-relu --quick-geglu", "--squared-relu and --quick-geglu cannot be combined"),
    ("--multi-latent-attention --rotary-interleaved",
     "--rotary-interleaved cannot be combined with --multi-latent-attention"),
])
def test_bad_combinations_are_one_line(capsys, extra, words):
    assert words in parse_error(capsys, f"{BASE} {extra}", 1)


@pytest.mark.parametrize("flag", ["--squared-relu", "--quick-geglu", "--rotary-interleaved",
                                  "--use-rope-scaling"])
def test_megatron_checkpoint_args_carry_the_flags_both_ways(flag):
    """A megamoe model written as a Megatron-LM run saves the field under Megatron's name
    (args.squared_relu, ...) and reading those args gives the flag back; before, a
    Megatron checkpoint with quick_geglu converted as a GELU model."""
    from megamoe.cli.megatron_args import flags_from_args, megatron_namespace

    field = flag[2:].replace("-", "_")
    base = dict(num_attention_heads=4, vocab_size=64, position_embedding_type="rope",
                add_bias_linear=False, normalization="RMSNorm")
    extra = {"rope_scaling_factor": 16.0} if field == "use_rope_scaling" else {}
    config = ModelConfig(**base, **{field: True}, **extra)
    ns = megatron_namespace({}, config, iteration=1, consumed_samples=0, padded_vocab=128)
    assert getattr(ns, field) is True
    assert flag in flags_from_args(ns)
    if extra:
        assert flags_from_args(ns)[flags_from_args(ns).index("--rope-scaling-factor") + 1] \
            == "16.0"
    ns_off = megatron_namespace({}, ModelConfig(**base), iteration=1, consumed_samples=0,
                                padded_vocab=128)
    assert flag not in flags_from_args(ns_off)


@pytest.mark.parametrize("extra, why", [
    ({"rotary_interleaved": True}, "--rotary-interleaved"),
    ({"swiglu": False, "quick_geglu": True}, "no --swiglu"),
    ({"swiglu": False, "squared_relu": True}, "no --swiglu"),
    ({"use_rope_scaling": True}, "--use-rope-scaling"),
])
def test_hf_export_refuses_what_transformers_cannot_express(extra, why):
    """A Mixtral-shaped model exports; with interleaved RoPE or another activation no
    transformers family computes it, so every family names its reason."""
    from megamoe.config import MoEConfig
    from megamoe.model.hf_families import family_of_model

    kw = dict(num_attention_heads=4, vocab_size=64, position_embedding_type="rope",
              normalization="RMSNorm", swiglu=True, add_bias_linear=False,
              moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=16))
    assert family_of_model(ModelConfig(**kw)).architecture == "MixtralForCausalLM"
    with pytest.raises(ValueError) as e:
        family_of_model(ModelConfig(**{**kw, **extra}))
    assert f"MixtralForCausalLM: {why}" in str(e.value)


def naive_llama3_inv_freq(rot: int, base: float, factor: float) -> list[float]:
    """Llama 3.1's scaling, one frequency at a time (Meta's apply_scaling: low / high
    frequency factors 1 and 4, original context 8192)."""
    out = []
    for j in range(rot // 2):
        freq = base ** (-2.0 * j / rot)
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            out.append(freq)
        elif wavelen > 8192 / 1:
            out.append(freq / factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def test_rope_scaling_matches_llama3_and_reaches_the_model():
    """--use-rope-scaling --rope-scaling-factor 32: the model's angles are position x the
    scaled frequencies (rot 64, base 500000: all three bands occur)."""
    kw = dict(num_layers=1, hidden_size=256, ffn_hidden_size=64, num_attention_heads=4,
              vocab_size=64, seq_length=8, max_position_embeddings=8,
              position_embedding_type="rope", rotary_base=500000.0)
    config = ModelConfig(use_rope_scaling=True, rope_scaling_factor=32.0, **kw)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    cos, sin = rotary_for(config, tokens, None)
    freq = torch.tensor(naive_llama3_inv_freq(64, 500000.0, 32.0), dtype=torch.float64)
    angle = torch.arange(8, dtype=torch.float64)[:, None] * freq
    ref = torch.cat((angle, angle), -1)[:, None, None, :]
    # fp32 angles (as Megatron's) against the double reference: position <= 7
    torch.testing.assert_close(cos.double(), ref.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin.double(), ref.sin(), rtol=0, atol=1e-6)
    bands = [f == b for f, b in zip(freq.tolist(), naive_llama3_inv_freq(64, 500000.0, 1.0))]
    assert any(bands) and not all(bands)
    _, plain = rotary_for(ModelConfig(**kw), tokens, None)
    assert (plain - sin).abs().max() > 1e-3
    inv = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(llama3_scaled_inv_freq(inv, 32.0), freq, rtol=1e-12, atol=0)


@pytest.mark.parametrize("extra, words", [
    ("--rope-scaling-factor 16", "--rope-scaling-factor needs --use-rope-scaling"),
    ("--use-rope-scaling", "--use-rope-scaling needs --position-embedding-type rope"),
    ("--position-embedding-type rope --use-rope-scaling --rope-scaling-factor 0",
     "--rope-scaling-factor must be > 0"),
])
def test_rope_scaling_refusals_are_one_line(capsys, extra, words):
    assert words in parse_error(capsys, f"{BASE} {extra}", 1)
