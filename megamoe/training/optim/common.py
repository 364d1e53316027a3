"""What the plain and the distributed optimizer share: parameter groups (Megatron's
weight-decay rule), the inner torch optimizer, and fp32 gradient accumulation."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megamoe.config import OptimizerConfig

try:  # NVIDIA apex (built from NVIDIA's repository; PyPI's "apex" is another package)
    from apex.optimizers import FusedAdam as _ApexFusedAdam
except Exception:  # noqa: BLE001 - absent, another package, or built without CUDA
    _ApexFusedAdam = None


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's rule: no weight decay on biases and on 1-D parameters (norm weights)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    # wd_mult (Megatron's): the scheduler sets weight_decay = scheduled value x wd_mult
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0})
    return [g for g in groups if g["params"]]


def build_inner_optimizer(groups: list[dict], config: OptimizerConfig
                          ) -> torch.optim.Optimizer:
    """The optimizer that updates the fp32 main parameters (--optimizer). Adam runs fused:
    on GPU main parameters NVIDIA apex's FusedAdam (AdamW mode) when apex is importable,
    else torch's fused AdamW, which also has a CPU kernel (16x faster there than the
    per-parameter loop, which reads each step count on the host). Same update rule
    everywhere (the kernels differ from the loop by rounding only)."""
    if config.optimizer != "adam":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum,
                               weight_decay=config.weight_decay)
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                  eps=config.adam_eps, weight_decay=config.weight_decay)
    on_gpu = _on_gpu(groups)
    if on_gpu and _ApexFusedAdam is not None:
        return _ApexFusedAdam(groups, adam_w_mode=True, **kwargs)
    on_cpu = all(p.device.type == "cpu" for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, fused=True if on_gpu or on_cpu else None, **kwargs)


def _on_gpu(groups: list[dict]) -> bool:
    return all(p.is_cuda for g in groups for p in g["params"])


def step_count(optimizer: torch.optim.Optimizer, state: dict) -> Optional[torch.Tensor]:
    """How many updates `optimizer` made, as a host fp32 scalar (checkpoints keep it in
    their common file, which must load on any machine): torch keeps it per parameter
    (state["step"], on the parameter's device when fused), apex's FusedAdam per group
    (group["step"], an int); None before the first."""
    if "step" in state:
        return state["step"].detach().to(device="cpu", dtype=torch.float32)  # host copy
    step = optimizer.param_groups[0].get("step") if optimizer.param_groups else None
    return None if step is None else torch.tensor(float(step), device="cpu")  # a counter


def restored_step(optimizer: torch.optim.Optimizer, step: torch.Tensor,
                  param: torch.Tensor) -> torch.Tensor:
    """A saved step count as `optimizer` keeps it for `param` (torch's own load rule): fp32
    on the parameter's device for a fused or capturable group, else a host scalar."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    if group.get("fused") or group.get("capturable"):  # (a copy per parameter: the kernels
        return step.to(device=param.device, dtype=torch.float32, copy=True)  # add in place)
    return step.clone()


def set_step_count(optimizer: torch.optim.Optimizer, step: Optional[torch.Tensor]) -> None:
    """The inverse of step_count for an optimizer that counts per group (apex)."""
    if step is not None and _ApexFusedAdam is not None and isinstance(optimizer,
                                                                      _ApexFusedAdam):
        for group in optimizer.param_groups:
            group["step"] = int(step)


def fp32_accumulate_hook(buf: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """Post-accumulate-grad hook: add the parameter's gradient to the fp32 `buf` and free
    it, so accumulation across micro-batches never rounds in the model dtype."""
    def hook(param: torch.Tensor) -> None:
        buf.add_(param.grad.float())
        param.grad = None
    return hook
