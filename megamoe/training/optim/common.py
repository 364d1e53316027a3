"""What the plain and the distributed optimizer share: parameter groups (Megatron's
weight-decay rule), the inner torch optimizer, and fp32 gradient accumulation."""

from __future__ import annotations

from typing import Callable

import torch

from megamoe.config import OptimizerConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's rule: no weight decay on biases and on 1-D parameters (norm weights)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def build_inner_optimizer(groups: list[dict], config: OptimizerConfig
                          ) -> torch.optim.Optimizer:
    """The torch optimizer that updates the fp32 main parameters (--optimizer)."""
    if config.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1,
                                                              config.adam_beta2),
                                 eps=config.adam_eps, weight_decay=config.weight_decay)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum,
                           weight_decay=config.weight_decay)


def fp32_accumulate_hook(buf: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """Post-accumulate-grad hook: add the parameter's gradient to the fp32 `buf` and free
    it, so accumulation across micro-batches never rounds in the model dtype."""
    def hook(param: torch.Tensor) -> None:
        buf.add_(param.grad.float())
        param.grad = None
    return hook
