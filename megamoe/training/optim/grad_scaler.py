"""Loss scaling for --fp16 (and a constant --loss-scale): Megatron-LM's grad scalers
(megatron/core/optimizer/grad_scaler.py, and optimizer.py's `_unscale_main_grads_and_
check_for_nan` for how a step uses them).

fp16 gradients underflow: the loss is multiplied by the scale before the backward (the
schedules, and the MoE / MTP auxiliary-loss gradients, which are injected inside the
backward: moe/losses.py), the fp32 main gradients are multiplied by 1 / scale after the
data-parallel reduction, and a NaN/Inf anywhere (an overflow of the scaled backward) skips
the step: weights, optimizer state and learning rate stay as they were.

ConstantGradScaler keeps the scale. DynamicGradScaler follows Megatron's rule exactly: an
overflow resets the growth tracker and spends one unit of hysteresis; with none left the
scale is multiplied by the backoff factor (not below the floor). `growth_interval`
overflow-free steps in a row multiply it by the growth factor and restore the hysteresis.

Megatron keeps the scale in an fp32 device tensor and reads the overflow flag on the host
(its one synchronisation). Here the scale lives on the host, rounded to fp32 after every
update as Megatron's tensor is, so the backward multiplies by a Python number (no device
tensor to keep in step) and logging reads it without a synchronisation; the overflow flag
is a device tensor, all-reduced (MAX) over every rank and read together with the gradient
norm in the step's one host read (mixed_precision.py, distributed.py).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megamoe.config import OptimizerConfig


def fp32(x: float) -> float:
    """`x` rounded to fp32, as Megatron's scale tensor holds it (overflow: inf). Host
    arithmetic (numpy), so no tensor op: nothing a device would wait for."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


class ConstantGradScaler:
    """--loss-scale: a fixed scale; an overflow still skips the step (Megatron's)."""

    def __init__(self, scale: float) -> None:
        assert scale > 0.0
        self.scale = fp32(scale)

    @property
    def inv_scale(self) -> float:
        """1 / scale computed in double and rounded to fp32 (Megatron's inv_scale)."""
        return fp32(1.0 / self.scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DynamicGradScaler(ConstantGradScaler):
    """--fp16 without --loss-scale (Megatron's DynamicGradScaler, growth 2, backoff 0.5)."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float,
                 backoff_factor: float, growth_interval: int, hysteresis: int) -> None:
        super().__init__(initial_scale)
        assert 0.0 < min_scale <= initial_scale
        assert growth_factor > 1.0 and 0.0 < backoff_factor < 1.0
        assert growth_interval > 0 and hysteresis > 0
        self.min_scale = fp32(min_scale)
        self.growth_factor, self.backoff_factor = fp32(growth_factor), fp32(backoff_factor)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(fp32(self.scale * self.backoff_factor), self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale = fp32(self.scale * self.growth_factor)

    def state_dict(self) -> dict:
        """Megatron's keys; plain numbers (the scale as a float, not a device tensor)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's scaler (checked by checkpoint/fields.py); an empty one (a run
        with a constant scale saved it) keeps this scaler's state."""
        if state:
            self.scale = fp32(float(state["scale"]))
            self.growth_tracker = int(state["growth_tracker"])
            self.hysteresis_tracker = int(state["hysteresis_tracker"])



def build_grad_scaler(config: OptimizerConfig, distributed: bool
                      ) -> Optional[ConstantGradScaler]:
    """Megatron's get_megatron_optimizer: a scaler only for fp16, bf16 or the distributed
    optimizer; constant when --loss-scale is given, else dynamic with --fp16, else none."""
    if not (config.fp16 or config.bf16 or distributed):
        return None
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=int(config.loss_scale_window),
                                 hysteresis=config.hysteresis)
    return None


@torch.no_grad()
def unscale_and_check(grads: list[torch.Tensor], scaler: ConstantGradScaler,
                      device: torch.device, agree: bool) -> torch.Tensor:
    """Multiply the fp32 main gradients `grads` by 1 / scale in place and return found_inf:
    a 1-element fp32 device tensor, > 0 when any rank's gradients hold a NaN/Inf (`agree`:
    all-reduced MAX over the default group, every rank; Megatron reduces it over the
    distributed optimizer's whole world, or the model-parallel group whose data-parallel
    replicas hold the same reduced gradients). No host synchronisation."""
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    inv = torch.full((1,), scaler.inv_scale, dtype=torch.float32, device=device)
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
    if agree:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return found_inf
