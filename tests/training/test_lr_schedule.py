"""Learning-rate schedule: Megatron's warm-up and decay curves."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.config import OptimizerConfig
from megamoe.training.schedules.lr import LRScheduler


def _lrs(steps: int, **kw) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = LRScheduler(opt, OptimizerConfig(**kw), train_iters=steps)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps + 2):
        sched.step(1)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_linear_warmup_then_cosine_to_min():
    lrs = _lrs(10, lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=10,
               lr_decay_style="cosine")
    assert lrs[:3] == pytest.approx([0.0, 0.5, 1.0])
    mid = 0.1 + 0.9 * 0.5 * (math.cos(math.pi * 4 / 8) + 1)
    assert lrs[6] == pytest.approx(mid)
    assert lrs[10] == pytest.approx(0.1) and lrs[12] == pytest.approx(0.1)


def test_linear_constant_and_warmup_init():
    assert _lrs(4, lr=1.0, min_lr=0.0, lr_decay_style="linear")[:5] == pytest.approx(
        [1.0, 0.75, 0.5, 0.25, 0.0])
    assert set(_lrs(4, lr=0.3, lr_decay_style="constant")) == {0.3}
    assert _lrs(4, lr=1.0, lr_warmup_init=0.2, lr_warmup_iters=2,
                lr_decay_style="constant")[:3] == pytest.approx([0.2, 0.6, 1.0])


def test_warmup_fraction_and_state_dict():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    cfg = OptimizerConfig(lr=1.0, lr_warmup_fraction=0.5, lr_decay_iters=8,
                          lr_decay_style="linear")
    sched = LRScheduler(opt, cfg, train_iters=8)
    assert sched.warmup_steps == 4
    sched.step(3)
    lr = opt.param_groups[0]["lr"]
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    restored = LRScheduler(other, cfg, train_iters=8)
    restored.load_state_dict(sched.state_dict())
    assert other.param_groups[0]["lr"] == lr == pytest.approx(0.75)
