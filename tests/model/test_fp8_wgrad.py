"""--no-fp8-wgrad (alias --disable-fp8-wgrad; Megatron-LM's, TE's override_linear_precision
(False, False, True), delayed scaling only): the weight-gradient GEMMs run in high precision
on the unquantised input and output gradient; forward and dgrad stay FP8. Checked against
the high-precision GEMM of the same tensors (exact: the same op on the same values) and
against the same GEMM with FP8 wgrad (forward and dgrad bitwise equal: same scales)."""

from __future__ import annotations

import shlex
import types

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import ConfigError
from megamoe.config.fp8 import Fp8Config
from megamoe.model.fp8.grouped import fp8_grouped_mm
from megamoe.model.fp8.linear import fp8_linear
from megamoe.model.fp8.policy import Fp8State
from megamoe.model.te.recipe import fp8_recipe
from tests.training.test_pretrain import TINY_MOE

CPU = torch.device("cpu")


def _scaling(fp8_wgrad: bool, n: int):
    config = Fp8Config(format="hybrid", recipe="delayed", fp8_wgrad=fp8_wgrad)
    return Fp8State(config).new_scaling("gemm", n, CPU)


def _grads(gemm, fp8_wgrad: bool, n: int, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemm(x, w, _scaling(fp8_wgrad, n))
    y.backward(g)
    return y.detach(), x.grad, w.grad


def test_dense_wgrad_is_the_high_precision_gemm_and_dgrad_stays_fp8():
    torch.manual_seed(0)
    x, w, g = torch.randn(48, 64), 0.05 * torch.randn(32, 64), torch.randn(48, 32)
    gemm = lambda x, w, s: fp8_linear(x, w, None, s)  # noqa: E731
    y_hp, dx_hp, dw_hp = _grads(gemm, False, 1, x, w, g)
    y_q, dx_q, dw_q = _grads(gemm, True, 1, x, w, g)
    assert torch.equal(dw_hp, g.t() @ x)  # the high-precision GEMM of the same inputs
    assert not torch.equal(dw_q, g.t() @ x)  # (with FP8 wgrad it is not)
    assert torch.equal(y_hp, y_q) and torch.equal(dx_hp, dx_q)  # forward, dgrad: FP8
    assert not torch.allclose(dx_hp, g @ w, rtol=1e-4, atol=1e-4)  # (dgrad is quantised)


def test_experts_wgrad_is_the_high_precision_gemm_and_dgrad_stays_fp8():
    """The grouped GEMM, per expert, an expert without rows included (zero wgrad)."""
    torch.manual_seed(1)
    sizes = [7, 0, 13]
    x, w, g = torch.randn(20, 16), torch.randn(3, 16, 8), torch.randn(20, 8)
    gemm = lambda x, w, s: fp8_grouped_mm(x, w, sizes, s)  # noqa: E731
    y_hp, dx_hp, dw_hp = _grads(gemm, False, 3, x, w, g)
    y_q, dx_q, dw_q = _grads(gemm, True, 3, x, w, g)
    expected = torch.stack([x[:7].t() @ g[:7], torch.zeros(16, 8), x[7:].t() @ g[7:]])
    assert torch.equal(dw_hp, expected)
    assert not torch.equal(dw_q, expected)
    assert torch.equal(y_hp, y_q) and torch.equal(dx_hp, dx_q)


def _run(extra: str):
    argv = shlex.split(f"{TINY_MOE} --train-iters 1 {extra}")
    return run_config_from_args(parse_args(argv, world_size=1), 97)


@pytest.mark.parametrize("flag", ["--no-fp8-wgrad", "--disable-fp8-wgrad"])
def test_both_names_reach_every_gemm_of_the_policy(flag):
    from megamoe.training.build import build_model
    model = build_model(_run(f"--fp8-format hybrid {flag}"))
    scalings = model.fp8_state.scalings.values()
    assert scalings and not any(s.fp8_wgrad for s in scalings)


def test_other_recipes_refuse_it_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        _run("--fp8-format hybrid --fp8-recipe tensorwise --no-fp8-wgrad")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "--no-fp8-wgrad applies to --fp8-recipe delayed only" in err, err


class _RecipeWithOverride:
    """A DelayedScaling of a TE that still has override_linear_precision (TE < 2.18)."""

    def __init__(self, margin=0, fp8_format=None, amax_history_len=1024,
                 amax_compute_algo="max", override_linear_precision=(False, False, False)):
        self.override_linear_precision = override_linear_precision


def test_te_recipe_gets_override_linear_precision_or_refuses():
    config = Fp8Config(format="e4m3", recipe="delayed", fp8_wgrad=False)
    fmt = types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")
    older = types.SimpleNamespace(recipe=types.SimpleNamespace(
        Format=fmt, DelayedScaling=_RecipeWithOverride))
    assert fp8_recipe(older, config).override_linear_precision == (False, False, True)
    from megamoe.model.te.loader import load_transformer_engine
    from tests.te_stand_in import installed
    with installed():  # TE v2.18's recorded DelayedScaling: no such field
        with pytest.raises(ConfigError, match="not supported yet: --no-fp8-wgrad with "
                                              "--transformer-impl transformer_engine"):
            fp8_recipe(load_transformer_engine(), config)


def test_launch_with_a_te_without_the_override_is_one_line(capsys):
    """pretrain_gpt.py with TE v2.18 (the stand-in): exit 2, one line (the recipe is made
    when the model is built: ConfigError)."""
    from megamoe.cli.main import main
    from tests.te_stand_in import installed
    argv = shlex.split(f"{TINY_MOE} --train-iters 1 --transformer-impl transformer_engine "
                       "--fp8-format hybrid --no-fp8-wgrad")
    with installed():
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not supported yet: --no-fp8-wgrad" in err, err
