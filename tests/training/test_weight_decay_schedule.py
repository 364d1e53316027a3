"""--weight-decay-incr-style / --start-weight-decay / --end-weight-decay: the weight decay
each optimizer group uses follows Megatron's OptimizerParamScheduler.get_wd (transcribed
below), over the whole run counted in samples, times the group's wd_mult (biases and norms
0)."""

from __future__ import annotations

import math
import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.training.optim.build import build_optimizer
from megamoe.training.schedules.lr import LRScheduler
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE


class MegatronWD:
    """Megatron-LM's OptimizerParamScheduler.get_wd (megatron/core/optimizer_param_scheduler
    .py at d98e8a64), transcribed: num_steps and wd_incr_steps in samples."""

    def __init__(self, start_wd, end_wd, wd_incr_steps, wd_incr_style):
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.num_steps = 0

    def get_wd(self):
        if self.num_steps > self.wd_incr_steps:
            return self.end_wd
        if self.wd_incr_style == 'constant':
            assert self.start_wd == self.end_wd
            return self.end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        assert incr_ratio >= 0.0
        assert incr_ratio <= 1.0
        delta_wd = self.end_wd - self.start_wd
        if self.wd_incr_style == 'linear':
            coeff = incr_ratio
        elif self.wd_incr_style == 'cosine':
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * delta_wd


@pytest.mark.parametrize("style,length", [("linear", "--train-iters 10"),
                                          ("cosine", "--train-samples 37"),
                                          ("constant", "--train-iters 10")])
def test_weight_decay_follows_megatron(style, length):
    ends = "" if style == "constant" else "--start-weight-decay 0.01 --end-weight-decay 0.1"
    base = TINY_MOE.replace("--lr-warmup-iters 1 ", "")
    args = parse_args(shlex.split(f"{base} {length} --weight-decay 0.05 "
                                  f"--weight-decay-incr-style {style} {ends}"), world_size=1)
    run = run_config_from_args(args, 97)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, run.optim)
    t = run.train
    scheduler = LRScheduler(optimizer, run.optim, t.train_iters, t.global_batch_size,
                            t.train_samples)
    constant = style == "constant"
    ref = MegatronWD(0.05 if constant else 0.01, 0.05 if constant else 0.1,
                     t.train_samples or t.train_iters * t.global_batch_size, style)
    seen = set()
    for _ in range(14):  # past the end of the run: the end value
        decay, no_decay = optimizer.param_groups
        assert decay["weight_decay"] == ref.get_wd() and no_decay["weight_decay"] == 0.0
        seen.add(decay["weight_decay"])
        scheduler.step(increment=t.global_batch_size)
        ref.num_steps += t.global_batch_size
    assert len(seen) == 1 if constant else len(seen) > 4
    assert optimizer.param_groups[0]["weight_decay"] == (0.05 if constant else 0.1)


def test_weight_decay_schedule_flag_rules(capsys):
    base = f"{TINY_MOE} --train-iters 2"
    assert "needs --start-weight-decay and --end-weight-decay" in parse_error(
        capsys, f"{base} --weight-decay-incr-style linear --start-weight-decay 0.1", 1)
    assert "need --weight-decay-incr-style linear or cosine" in parse_error(
        capsys, f"{base} --start-weight-decay 0.1 --end-weight-decay 0.2", 1)
