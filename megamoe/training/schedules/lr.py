"""Learning-rate schedule with Megatron's OptimizerParamScheduler semantics (in iterations).

Warm up linearly from --lr-warmup-init to --lr over the warm-up iterations, then decay to
--min-lr over --lr-decay-iters (linear, cosine, inverse-square-root, WSD or constant), and
stay at --min-lr afterwards. The rate for update n is the one computed at step n-1, as in
Megatron (the scheduler steps after the optimizer).
"""

from __future__ import annotations

import math

from megamoe.config import OptimizerConfig


class LRScheduler:
    def __init__(self, optimizer, config: OptimizerConfig, train_iters: int) -> None:
        self.optimizer = optimizer
        self.max_lr = config.lr
        self.min_lr = config.min_lr
        self.init_lr = config.lr_warmup_init
        self.style = config.lr_decay_style
        self.decay_steps = config.lr_decay_iters or train_iters
        if config.lr_warmup_fraction is not None:
            self.warmup_steps = int(config.lr_warmup_fraction * self.decay_steps)
        else:
            self.warmup_steps = config.lr_warmup_iters
        self.wsd_decay_steps = config.lr_wsd_decay_iters
        self.wsd_style = config.lr_wsd_decay_style
        self.num_steps = 0
        self.step(increment=0)

    def get_lr(self) -> float:
        n = self.num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * n / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        delta = self.max_lr - self.min_lr
        if self.style == "inverse-square-root":
            warm = max(self.warmup_steps, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warm) / math.sqrt(max(n, 1)))
        span = self.decay_steps - self.warmup_steps
        ratio = (n - self.warmup_steps) / span if span > 0 else 1.0
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif self.style == "WSD":
            anneal = self.wsd_decay_steps or 0
            anneal_start = self.decay_steps - anneal
            if n <= anneal_start:
                coeff = 1.0
            else:
                r = (n - anneal_start) / max(anneal, 1)
                coeff = {
                    "linear": 1.0 - r,
                    "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                    "exponential": 2.0 * (0.5 ** r) - 1.0,
                    "minus_sqrt": 1.0 - math.sqrt(r),
                }[self.wsd_style]
        else:
            raise ValueError(f"--lr-decay-style: unknown style {self.style!r}")
        return self.min_lr + coeff * delta

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self.step(increment=0)
