"""The Adam step count survives any number of resumes, whichever Adam runs: torch's fused
kernel (step per parameter, a device tensor), torch's foreach loop (step per parameter, a
host tensor) and apex's FusedAdam (step per group, an int: tests/apex_stand_in.py), in the
plain and the distributed optimizer.

A run saved at step 3, resumed, saved at step 5 and resumed again to step 7 must hold, at
every save and at the end, exactly the weights, Adam states and step count of the run that
never stopped (one process, the same kernels: equal bitwise). The step matters beyond its
own value: Adam's bias correction divides by 1 - beta^step.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.config import OptimizerConfig
from megamoe.training.optim import build_optimizer, common, distributed, mixed_precision
from megamoe.training.optim.distributed import DistributedOptimizer
from tests import apex_stand_in

CONFIG = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta2=0.95)


def _foreach_adam(groups, config):
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_eps, weight_decay=config.weight_decay, foreach=True)


def _use(kind: str, monkeypatch) -> None:
    if kind == "torch-foreach":
        for module in (mixed_precision, distributed):
            monkeypatch.setattr(module, "build_inner_optimizer", _foreach_adam)
    elif kind == "apex":
        apex_stand_in.install(monkeypatch)
        monkeypatch.setattr(common, "_on_gpu", lambda groups: True)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def _build(which: str, model):
    if which == "distributed":
        return DistributedOptimizer(model, CONFIG, tp_group=None, dp_group=None)
    return build_optimizer(model, CONFIG)


def _train(model, opt, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        opt.zero_grad()
        model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        opt.step()


def _snapshot(model, opt) -> dict:
    """What a checkpoint keeps (copies: a snapshot)."""
    states, step, _ = opt.param_states()
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "states": [{k: v.clone() for k, v in s.items()} for s in states],
            "step": None if step is None else step.clone()}


def _resume(which: str, saved: dict):
    model = _model()
    with torch.no_grad():
        model.load_state_dict(saved["model"])
    opt = _build(which, model)
    opt.load_param_states(saved["states"], saved["step"])
    return model, opt


def _assert_same(got: dict, want: dict, where: str) -> None:
    assert float(got["step"]) == float(want["step"]), (where, got["step"], want["step"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), (where, k)
    for i, (a, b) in enumerate(zip(got["states"], want["states"])):
        assert a.keys() == b.keys(), (where, i)
        for k in b:
            assert torch.equal(a[k], b[k]), (where, i, k)


@pytest.mark.parametrize("which", ["plain", "distributed"])
@pytest.mark.parametrize("kind", ["torch-fused", "torch-foreach", "apex"])
def test_adam_step_survives_two_resumes(monkeypatch, kind, which):
    _use(kind, monkeypatch)
    model = _model()
    opt = _build(which, model)
    expected = {"torch-fused": torch.optim.AdamW, "torch-foreach": torch.optim.AdamW,
                "apex": apex_stand_in.FusedAdam}[kind]
    assert type(opt.optimizer) is expected
    straight = {}
    for stop in (3, 5, 7):
        _train(model, opt, range(stop - 2 if stop > 3 else 0, stop))
        straight[stop] = _snapshot(model, opt)
    assert float(straight[7]["step"]) == 7

    model, opt = _resume(which, _init_then_train(which, 3))
    _train(model, opt, range(3, 5))
    at5 = _snapshot(model, opt)
    _assert_same(at5, straight[5], "saved at 5")
    model, opt = _resume(which, at5)
    _train(model, opt, range(5, 7))
    _assert_same(_snapshot(model, opt), straight[7], "after the second resume")


def _init_then_train(which: str, steps: int) -> dict:
    model = _model()
    opt = _build(which, model)
    _train(model, opt, range(steps))
    return _snapshot(model, opt)


def test_the_apex_stand_in_updates_as_torch_adamw(monkeypatch):
    """The stand-in's math (apex's multi_tensor_adam, AdamW mode) is torch's AdamW up to
    fp32 rounding (the two order the same operations differently): a wrong stand-in would
    make the resume test above prove nothing."""
    apex_stand_in.install(monkeypatch)
    a, b = _model(), _model()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opts = (apex_stand_in.FusedAdam(a.parameters(), **kw),
            torch.optim.AdamW(b.parameters(), foreach=False, **kw))
    for model, opt in zip((a, b), opts):
        _train(model, opt, range(4))
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert opts[0].param_groups[0]["step"] == 4 and "step" not in opts[0].state[p]
