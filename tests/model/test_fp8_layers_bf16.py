"""--first-last-layers-bf16 (Megatron-LM's, with --num-layers-at-start-in-bf16 /
--num-layers-at-end-in-bf16): the first and last N decoder layers, by global layer number,
run without FP8; the others and the MTP layers keep it. Proven by spying on the
quantisation and by comparing each layer with the same layer of the model without FP8."""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config.fp8 import Fp8Config
from megamoe.model.fp8 import grouped, linear
from megamoe.model.fp8.policy import high_precision_layer
from megamoe.training.build import build_model
from tests.training.test_pretrain import TINY_MOE

FP8 = "--fp8-format e4m3 --fp8-recipe tensorwise"


def _run(extra: str, world: int = 1):
    argv = shlex.split(f"{TINY_MOE} --num-layers 4 --train-iters 1 {extra}")
    return run_config_from_args(parse_args(argv, world_size=world), 97)


@pytest.mark.parametrize("start,end,expected", [(1, 1, {0, 5}), (2, 1, {0, 1, 5}),
                                                (0, 2, {4, 5}), (0, 0, set())])
def test_which_layers_megatrons_rule(start, end, expected):
    """Megatron's is_first_last_bf16_layer on 6 layers; MTP layers (6, 7) never."""
    c = Fp8Config(format="e4m3", recipe="tensorwise", first_last_layers_bf16=True,
                  num_layers_at_start_in_bf16=start, num_layers_at_end_in_bf16=end)
    assert {i for i in range(8) if high_precision_layer(c, i, 6)} == expected
    c.first_last_layers_bf16 = False  # the counts alone change nothing
    assert not any(high_precision_layer(c, i, 6) for i in range(8))


def _count_quantisations(monkeypatch) -> list[int]:
    calls = [0]
    for module in (linear, grouped):
        real = module.quantize

        def spy(*a, _real=real, **k):
            calls[0] += 1
            return _real(*a, **k)
        monkeypatch.setattr(module, "quantize", spy)
    return calls


def test_first_and_last_layers_do_not_quantise(monkeypatch):
    """4 layers, --first-last-layers-bf16 (1 / 1): layers 0 and 3 quantise nothing and
    equal the no-FP8 model's layers exactly (same weights, same input), forward and
    backward; layers 1 and 2 quantise and differ."""
    plain = build_model(_run(""))
    fp8 = build_model(_run(f"{FP8} --first-last-layers-bf16"))
    calls = _count_quantisations(monkeypatch)
    torch.manual_seed(0)
    x_SBH = torch.randn(16, 2, 32)
    for i in range(4):
        outs, grads = [], []
        for model in (plain, fp8):
            x = x_SBH.clone().requires_grad_()
            before = calls[0]
            y = model.decoder.layers[i](x)
            y.square().sum().backward()
            outs.append(y.detach())
            grads.append(x.grad)
            quantised = calls[0] - before
        if i in (0, 3):
            assert quantised == 0, i
            assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1]), i
        else:
            assert quantised > 0, i
            assert not torch.equal(outs[0], outs[1]), i
    named = {n for n, m in fp8.named_modules() if getattr(m, "fp8", None) is not None}
    assert {n.split(".")[2] for n in named} == {"1", "2"}


def test_mtp_layers_stay_in_fp8():
    fp8 = build_model(_run(f"{FP8} --first-last-layers-bf16 --mtp-num-layers 1"))
    named = {n for n, m in fp8.named_modules() if getattr(m, "fp8", None) is not None}
    assert any(n.startswith("mtp.") for n in named), named
    assert not any(n.startswith(("decoder.layers.0.", "decoder.layers.3.")) for n in named)


@pytest.mark.parametrize("extra,says", [
    ("--fp8-format e4m3 --first-last-layers-bf16",
     "--first-last-layers-bf16: delayed scaling does not support first / last layer in BF16"),
    (f"{FP8} --first-last-layers-bf16 --num-layers-at-start-in-bf16 5",
     "--num-layers-at-start-in-bf16 (5) must be between 0 and the number of layers per "
     "pipeline stage (4)"),
    (f"{FP8} --first-last-layers-bf16 --num-layers-at-end-in-bf16 3 "
     "--pipeline-model-parallel-size 2",
     "--num-layers-at-end-in-bf16 (3) must be between 0 and the number of layers per "
     "pipeline stage (2)"),
])
def test_megatrons_refusals_are_one_line(capsys, extra, says):
    with pytest.raises(SystemExit) as exit_:
        _run(extra, world=2 if "pipeline" in extra else 1)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err and err.count("\n") == 1, err


def test_te_path_runs_those_layers_outside_fp8_autocast():
    """--transformer-impl transformer_engine (the TE stand-in): layer 0 (start 1, end 0)
    calls TE's modules with no FP8 recipe active, layers 1-3 under Float8CurrentScaling."""
    from tests.te_stand_in import installed
    extra = (f"--transformer-impl transformer_engine {FP8} --first-last-layers-bf16 "
             "--num-layers-at-end-in-bf16 0")
    with installed() as te:
        model = build_model(_run(extra))
        recipes = []
        for layer in model.decoder.layers:
            te.CALLS.clear()
            layer(torch.randn(16, 2, 32))
            recipes.append({type(r).__name__ for _, r in te.CALLS})
    assert recipes == [{"NoneType"}] + [{"Float8CurrentScaling"}] * 3, recipes
