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


def megatron_lr(n: float, warmup: float, decay: float, style: str, max_lr: float = 1.0,
                min_lr: float = 0.1, init_lr: float = 0.0, wsd: float = 0.0,
                wsd_style: str = "linear") -> float:
    """Megatron's OptimizerParamScheduler.get_lr at num_steps = n (megatron/core/
    optimizer_param_scheduler.py), written out here independently of lr.py."""
    if warmup > 0 and n <= warmup:
        return init_lr + (max_lr - init_lr) * n / warmup
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
    ratio = (n - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD
        start = decay - wsd
        r = (n - start) / wsd
        coeff = 1.0 if n <= start else {"linear": 1.0 - r,
                                        "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                                        "exponential": 2.0 * 0.5 ** r - 1.0,
                                        "minus_sqrt": 1.0 - math.sqrt(r)}[wsd_style]
    return min_lr + coeff * (max_lr - min_lr)


def _sample_lrs(batches: list[int], train_samples: int, **kw) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = LRScheduler(opt, OptimizerConfig(lr=1.0, min_lr=0.1, **kw), train_iters=0,
                        global_batch_size=max(batches), train_samples=train_samples)
    out = [opt.param_groups[0]["lr"]]
    for b in batches:
        sched.step(b)
        out.append(opt.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "constant"])
def test_sample_based_schedule_is_megatrons_formula_in_samples(style):
    """--train-samples: warm-up and decay lengths are the *-samples flags, and num_steps
    counts the samples of each step (a growing batch, as under --rampup-batch-size)."""
    batches = [2, 2, 4, 4, 6, 8, 8, 8, 8, 8, 8, 8]
    lrs = _sample_lrs(batches, train_samples=100, lr_warmup_samples=7,
                      lr_decay_samples=50, lr_decay_style=style)
    consumed = [sum(batches[:i]) for i in range(len(batches) + 1)]
    assert lrs == pytest.approx([megatron_lr(n, 7, 50, style) for n in consumed],
                                rel=1e-13, abs=0)


def test_sample_based_defaults_fraction_and_wsd():
    # decay over --train-samples by default; the warm-up fraction is of the decay samples
    # (not rounded: 0.15 * 62 = 9.3); WSD anneals over --lr-wsd-decay-samples
    batches = [4] * 16
    consumed = [4 * i for i in range(17)]
    lrs = _sample_lrs(batches, train_samples=62, lr_warmup_fraction=0.15,
                      lr_decay_style="cosine")
    assert lrs == pytest.approx([megatron_lr(n, 0.15 * 62, 62, "cosine") for n in consumed],
                                rel=1e-13, abs=0)
    lrs = _sample_lrs(batches, train_samples=60, lr_decay_samples=50, lr_decay_style="WSD",
                      lr_wsd_decay_samples=20, lr_wsd_decay_style="linear")
    assert lrs == pytest.approx([megatron_lr(n, 0, 50, "WSD", wsd=20) for n in consumed],
                                rel=1e-13, abs=0)


def test_iteration_based_schedule_counts_samples_as_megatron():
    """--train-iters: Megatron's lengths are iterations x --global-batch-size samples, so a
    --lr-warmup-fraction that is not a whole number of iterations is not rounded to one:
    0.1 x 15 iterations x 4 = 6 samples of warm-up, 1.5 iterations."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_fraction=0.1, lr_decay_iters=15,
                          lr_decay_style="linear")
    sched = LRScheduler(opt, cfg, train_iters=15, global_batch_size=4)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(16):
        sched.step(4)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([megatron_lr(4 * i, 6.0, 60, "linear") for i in range(17)],
                                rel=1e-13, abs=0)
    assert lrs[1] == pytest.approx(4 / 6)


def test_checkpoint_without_unit_counted_iterations():
    """Checkpoints written before the schedule counted samples hold iterations: loading
    one gives the rate of that many global batches."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    cfg = OptimizerConfig(lr=1.0, lr_decay_iters=10, lr_decay_style="linear")
    sched = LRScheduler(opt, cfg, train_iters=10, global_batch_size=8)
    sched.load_state_dict({"num_steps": 3})
    assert sched.num_steps == 24 and opt.param_groups[0]["lr"] == pytest.approx(0.7)
    assert sched.state_dict() == {"num_steps": 24, "unit": "samples"}
    sched.load_state_dict(sched.state_dict())
    assert sched.num_steps == 24
