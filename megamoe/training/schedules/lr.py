"""Learning-rate schedule with Megatron's OptimizerParamScheduler semantics, counted in
samples as Megatron counts it.

Warm up linearly from --lr-warmup-init to --lr, then decay to --min-lr (linear, cosine,
inverse-square-root, WSD or constant), and stay at --min-lr afterwards. The scheduler steps
after each successful optimizer step by the samples of that step (the step's global batch
size, which grows during --rampup-batch-size), so the rate for update n is the one computed
after update n-1, as in Megatron. The lengths come from Megatron's
get_optimizer_param_scheduler:
- iteration-based training (--train-iters): the *-iters flags times --global-batch-size;
  the decay defaults to --train-iters;
- sample-based training (--train-samples): --lr-warmup-samples, --lr-decay-samples
  (default --train-samples) and --lr-wsd-decay-samples as given;
- --lr-warmup-fraction: that fraction of the decay length (not rounded).
The weight decay follows Megatron's get_wd: constant --weight-decay, or from
--start-weight-decay to --end-weight-decay (linear or cosine) over the whole run (train
iterations x global batch size, or --train-samples), then the end value; each parameter
group's weight_decay is that value times its wd_mult (0 for biases and norms).
A parameter group with its own "max_lr" / "min_lr" (--decoupled-lr: the embedding and the
output layer, training/optim/common.py) follows the same schedule between its own peak and
floor, as Megatron's get_lr(param_group); the bounds are read from the groups when the
scheduler is built, so this run's flags (not a loaded checkpoint's groups) set them.
"""

from __future__ import annotations

import math
from typing import Optional

from megamoe.config import OptimizerConfig


def schedule_lengths(config: OptimizerConfig, train_iters: int, global_batch_size: int,
                     train_samples: Optional[int]) -> tuple[float, int, Optional[int]]:
    """(warm-up, decay, WSD anneal) lengths in samples, as Megatron's
    get_optimizer_param_scheduler computes them."""
    if train_samples is not None:
        decay = config.lr_decay_samples or train_samples
        wsd = config.lr_wsd_decay_samples
        warmup = config.lr_warmup_samples
    else:
        decay = (config.lr_decay_iters or train_iters) * global_batch_size
        wsd = (config.lr_wsd_decay_iters * global_batch_size
               if config.lr_wsd_decay_iters is not None else None)
        warmup = config.lr_warmup_iters * global_batch_size
    if config.lr_warmup_fraction is not None:
        warmup = config.lr_warmup_fraction * decay
    return warmup, decay, wsd


class LRScheduler:
    """`global_batch_size` and `train_samples` as the run's (TrainConfig); the defaults make
    one step of increment 1 one iteration of a batch of one sample."""

    # What num_steps counts in state_dict(); checkpoints without it counted iterations.
    UNIT = "samples"

    def __init__(self, optimizer, config: OptimizerConfig, train_iters: int,
                 global_batch_size: int = 1, train_samples: Optional[int] = None) -> None:
        self.optimizer = optimizer
        self.max_lr = config.lr
        self.min_lr = config.min_lr
        self.init_lr = config.lr_warmup_init
        self.style = config.lr_decay_style
        self.global_batch_size = global_batch_size
        self.warmup_steps, self.decay_steps, self.wsd_decay_steps = schedule_lengths(
            config, train_iters, global_batch_size, train_samples)
        self.wsd_style = config.lr_wsd_decay_style
        self.wd_style = config.weight_decay_incr_style
        constant = self.wd_style == "constant"
        self.start_wd = config.weight_decay if constant else config.start_weight_decay
        self.end_wd = config.weight_decay if constant else config.end_weight_decay
        self.wd_incr_steps = (train_samples if train_samples is not None
                              else train_iters * global_batch_size)
        # (max_lr, min_lr) per parameter group: its own (decoupled) or the run's
        self.group_bounds = [(g.get("max_lr", self.max_lr), g.get("min_lr", self.min_lr))
                             for g in optimizer.param_groups]
        self.num_steps = 0
        self.step(increment=0)

    def get_lr(self, max_lr: Optional[float] = None, min_lr: Optional[float] = None) -> float:
        """Megatron's OptimizerParamScheduler.get_lr(param_group), expression for
        expression: the run's --lr / --min-lr unless a group's bounds are given."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        n = self.num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(n)
                                   / float(self.warmup_steps))
        if self.style == "constant":
            return max_lr
        if n > self.decay_steps:
            return min_lr
        if self.style == "inverse-square-root":
            warmup_steps = max(self.warmup_steps, 1)
            num_steps = max(n, 1)
            return max(min_lr, max_lr * warmup_steps ** 0.5 / (num_steps ** 0.5))
        span = self.decay_steps - self.warmup_steps
        ratio = float(n - self.warmup_steps) / float(span) if span > 0 else 1.0
        delta = max_lr - min_lr
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif self.style == "WSD":
            coeff = self._wsd_coeff(n)
        else:
            raise ValueError(f"--lr-decay-style: unknown style {self.style!r}")
        return min_lr + coeff * delta

    def get_wd(self) -> float:
        """Megatron's OptimizerParamScheduler.get_wd."""
        n = self.num_steps
        if n > self.wd_incr_steps or self.wd_style == "constant" or self.wd_incr_steps <= 0:
            return self.end_wd
        ratio = float(n) / float(self.wd_incr_steps)
        if self.wd_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def _wsd_coeff(self, n: float) -> float:
        anneal = self.wsd_decay_steps or 0
        anneal_start = self.decay_steps - anneal
        if n <= anneal_start:
            return 1.0
        r = float(n - anneal_start) / float(max(anneal, 1))
        if self.wsd_style == "linear":
            return 1.0 - r
        if self.wsd_style == "cosine":
            return 0.5 * (math.cos(math.pi * r) + 1.0)
        if self.wsd_style == "exponential":
            return (2.0 * math.pow(0.5, r)) - 1.0
        return 1.0 - math.sqrt(r)  # minus_sqrt

    def step(self, increment: int = 1) -> None:
        """Advance by `increment` samples (the training loop passes the step's global
        batch size, as Megatron)."""
        self.num_steps += increment
        self.last_lr = self.get_lr()  # the run's own schedule: what the log line shows
        wd = self.get_wd()
        for group, (max_lr, min_lr) in zip(self.optimizer.param_groups, self.group_bounds):
            group["lr"] = self.get_lr(max_lr, min_lr)
            if "wd_mult" in group:
                group["weight_decay"] = wd * group["wd_mult"]

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "unit": self.UNIT}

    def load_state_dict(self, state: dict) -> None:
        steps = int(state["num_steps"])
        if state.get("unit") != self.UNIT:  # an older checkpoint counted iterations, all
            steps *= self.global_batch_size  # of --global-batch-size samples
        self.num_steps = steps
        self.step(increment=0)
