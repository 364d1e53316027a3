"""--moe-router-padding-for-quantization (alias --moe-router-padding-for-fp8; Megatron-LM's
pad_routing_map): each expert's token count becomes a multiple of 16 (32 under mxfp8) by
routing it probability-0 copies of tokens it did not have; the layer's output and
gradients are the unpadded ones. Checked against a naive loop and against the same layer
without padding."""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.moe.layer import MoELayer
from megamoe.moe.quantization_padding import pad_routing_map
from megamoe.training.build import build_model
from tests.training.test_pretrain import TINY_MOE


def _naive_pad(map_TE: torch.Tensor, multiple: int) -> torch.Tensor:
    out = map_TE.clone()
    for e in range(map_TE.shape[1]):
        need = (-int(map_TE[:, e].sum())) % multiple
        for t in range(map_TE.shape[0]):
            if need and not out[t, e]:
                out[t, e], need = True, need - 1
    return out


@pytest.mark.parametrize("tokens,multiple", [(40, 16), (100, 32), (10, 16)])
def test_pad_routing_map_against_a_naive_loop(tokens, multiple):
    gen = torch.Generator().manual_seed(tokens)
    map_TE = torch.rand(tokens, 6, generator=gen) < 0.3
    map_TE[:, 5] = False  # an expert without tokens stays at 0
    padded = pad_routing_map(map_TE, multiple)
    assert torch.equal(padded, _naive_pad(map_TE, multiple))
    assert bool((padded | ~map_TE).all())  # the real assignments are kept
    counts = padded.sum(0)
    if tokens >= multiple:
        assert bool((counts % multiple == 0).all()), counts


def _model(extra: str = ""):
    argv = shlex.split(f"{TINY_MOE} --train-iters 1 {extra}")
    return build_model(run_config_from_args(parse_args(argv, world_size=1), 97))


def _moe_layers(model) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


@pytest.mark.parametrize("recipe,multiple", [("tensorwise", 16), ("mxfp8", 32)])
def test_both_names_set_the_recipes_alignment_on_every_moe_layer(recipe, multiple):
    for name in ("--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8"):
        layers = _moe_layers(_model(f"--fp8-format e4m3 --fp8-recipe {recipe} {name}"))
        assert layers and all(m.quantization_alignment == multiple for m in layers)
    assert all(m.quantization_alignment == 0
               for m in _moe_layers(_model(f"--fp8-format e4m3 --fp8-recipe {recipe}")))


def test_padded_layer_equals_the_unpadded_layer_and_counts_are_multiples():
    """The same weights (high precision: FP8 would rescale each expert's rows with the
    padded rows' amax), padded to 16: output and every gradient equal the unpadded layer's
    (the padded copies are multiplied by probability 0), and the experts see multiples."""
    model = _model()
    layer = _moe_layers(model)[0]
    seen = []
    layer.experts.register_forward_pre_hook(
        lambda _m, args: seen.append(torch.as_tensor(args[1]).clone()))
    torch.manual_seed(0)
    x = torch.randn(16, 2, 32)
    results = []
    for alignment in (0, 16):
        layer.quantization_alignment = alignment
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        results.append((y.detach(), xi.grad, grads))
    (y0, dx0, g0), (y1, dx1, g1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)  # (sum order of zero rows)
    torch.testing.assert_close(dx1, dx0, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)
    assert not bool((seen[0] % 16 == 0).all())  # (unpadded counts are not multiples)
    assert bool((seen[1] % 16 == 0).all()) and int(seen[1].sum()) > int(seen[0].sum())


@pytest.mark.parametrize("extra,says", [
    ("--moe-router-padding-for-quantization",
     "--moe-router-padding-for-quantization needs --fp8-format"),
    ("--fp8-format e4m3 --moe-router-padding-for-fp8 --moe-expert-capacity-factor 1.0",
     "not supported yet: --moe-router-padding-for-quantization with "
     "--moe-expert-capacity-factor"),
    ("--fp8-format e4m3 --moe-router-padding-for-quantization --tensor-model-parallel-size 2 "
     "--sequence-parallel", "not supported yet: --moe-router-padding-for-quantization with "
     "--tensor-model-parallel-size > 1"),
])
def test_refusals_are_one_line(capsys, extra, says):
    world = 2 if "parallel-size 2" in extra else 1
    with pytest.raises(SystemExit) as exit_:
        parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 {extra}"), world_size=world)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and says in err, err
