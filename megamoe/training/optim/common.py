"""What the plain and the distributed optimizer share: parameter groups (Megatron's
weight-decay rule), the inner torch optimizer, and fp32 gradient accumulation."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megamoe.config import OptimizerConfig
from megamoe.model.apex_kernels import apex_kernels
from megamoe.training.optim.state_precision import StoredStates, state_dtypes


def no_weight_decay(name: str, param: torch.Tensor, apply_wd_to_qk_layernorm: bool) -> bool:
    """Megatron's get_standard_config_overrides: biases and 1-D parameters (norm weights)
    get wd_mult 0; with --apply-wd-to-qk-layernorm the q/k layernorms' own parameters
    ("q_layernorm." or "k_layernorm." in the name) keep their weight decay."""
    skip = param.ndim == 1 or name.endswith(".bias")
    if skip and apply_wd_to_qk_layernorm:
        skip = not ("q_layernorm." in name or "k_layernorm." in name)
    return skip


# The parameters Megatron marks is_embedding_or_output_parameter (LanguageModule's
# setup_embeddings_and_output_layer): the word embedding and the output layer's weight,
# including a last pipeline stage's copy of a tied embedding (shared_output_weight).
EMBEDDING_OR_OUTPUT = (("embedding", "word_embeddings", "weight"), ("output_layer", "weight"),
                       ("shared_output_weight",))


def is_embedding_or_output(name: str) -> bool:
    parts = tuple(name.split("."))
    return any(parts[-len(tail):] == tail for tail in EMBEDDING_OR_OUTPUT)


def param_groups(model: torch.nn.Module, config: OptimizerConfig) -> list[dict]:
    """Megatron's _get_param_groups with its standard overrides: one group per (weight
    decay?, decoupled LR?) combination, in that order. A decoupled group carries its own
    "max_lr" / "min_lr" (--decoupled-lr, --decoupled-min-lr or --min-lr), which the
    scheduler reads (schedules/lr.py), as Megatron's OptimizerParamScheduler; "wd_mult":
    the scheduler sets weight_decay = scheduled value x wd_mult."""
    buckets: dict[tuple[bool, bool], list] = {}
    decoupled = config.decoupled_lr is not None
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        key = (no_weight_decay(name, p, config.apply_wd_to_qk_layernorm),
               decoupled and is_embedding_or_output(name))
        buckets.setdefault(key, []).append(p)
    groups = []
    for (skip_wd, own_lr), params in sorted(buckets.items()):
        group = {"params": params, "weight_decay": 0.0 if skip_wd else config.weight_decay,
                 "wd_mult": 0.0 if skip_wd else 1.0}
        if own_lr:
            group.update(max_lr=config.decoupled_lr,
                         min_lr=config.decoupled_min_lr if config.decoupled_min_lr is not None
                         else config.min_lr)
        groups.append(group)
    return groups


def build_inner_optimizer(groups: list[dict], config: OptimizerConfig):
    """The optimizer that updates the fp32 main parameters; with
    --use-precision-aware-optimizer and an --exp-avg-dtype / --exp-avg-sq-dtype below fp32,
    wrapped so that those states are stored in their dtype between steps
    (state_precision.py)."""
    inner = _fp32_optimizer(groups, config)
    dtypes = state_dtypes(config.exp_avg_dtype, config.exp_avg_sq_dtype) \
        if config.use_precision_aware_optimizer else {}
    return StoredStates(inner, dtypes) if dtypes else inner


def _fp32_optimizer(groups: list[dict], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer that updates the fp32 main parameters (--optimizer). Adam runs fused:
    on GPU main parameters NVIDIA apex's FusedAdam (AdamW mode) when its CUDA extension
    loads (model/apex_kernels.py), else torch's fused AdamW, which also has a CPU kernel
    (16x faster there than the per-parameter loop, which reads each step count on the
    host). Same update rule
    everywhere (the kernels differ from the loop by rounding only)."""
    if config.optimizer != "adam":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum,
                               weight_decay=config.weight_decay)
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                  eps=config.adam_eps, weight_decay=config.weight_decay)
    on_gpu = _on_gpu(groups)
    apex_adam = apex_kernels().fused_adam if on_gpu else None
    if apex_adam is not None:
        return apex_adam(groups, adam_w_mode=True, **kwargs)
    on_cpu = all(p.device.type == "cpu" for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, fused=True if on_gpu or on_cpu else None, **kwargs)


def _on_gpu(groups: list[dict]) -> bool:
    return all(p.is_cuda for g in groups for p in g["params"])


def counts_per_group(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` keeps its step count per parameter group, as apex's optimizers
    do (FusedAdam: group["step"], an int that every step() advances and the kernel's bias
    correction reads; no per-parameter "step"), rather than per parameter as torch's."""
    inner = getattr(optimizer, "inner", optimizer)  # (under a StoredStates)
    return type(inner).__module__.split(".")[0] == "apex"


def step_count(optimizer: torch.optim.Optimizer, state: dict) -> Optional[torch.Tensor]:
    """How many updates `optimizer` made, as a host fp32 scalar (checkpoints keep it in
    their common file, which must load on any machine): torch keeps it per parameter
    (state["step"], on the parameter's device when fused), apex per group; None before
    the first. Only the counter the optimizer advances is read: a per-group optimizer's
    state may hold a stale "step" (one written by an older load)."""
    if counts_per_group(optimizer):
        steps = [int(g["step"]) for g in optimizer.param_groups if "step" in g]
        return torch.tensor(float(max(steps)), device="cpu") if steps else None  # a counter
    if "step" in state:
        # copy=True: `.to` of a host fp32 tensor returns the live counter itself
        return state["step"].detach().to(device="cpu", dtype=torch.float32, copy=True)
    return None


def restored_step(optimizer: torch.optim.Optimizer, step: Optional[torch.Tensor],
                  param: torch.Tensor) -> dict[str, torch.Tensor]:
    """A saved step count as `optimizer` keeps it in `param`'s state (torch's own load
    rule): fp32 on the parameter's device for a fused or capturable group, else a host
    scalar; nothing for a per-group counter (set_step_count) or before the first step."""
    if step is None or counts_per_group(optimizer):
        return {}
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    if group.get("fused") or group.get("capturable"):  # (a copy per parameter: the kernels
        return {"step": step.to(device=param.device, dtype=torch.float32, copy=True)}
    return {"step": step.clone()}  # (add in place)


def set_step_count(optimizer: torch.optim.Optimizer, step: Optional[torch.Tensor]) -> None:
    """The per-group half of restored_step, for an optimizer that counts per group."""
    if step is not None and counts_per_group(optimizer):
        for group in optimizer.param_groups:
            group["step"] = int(step)


def bf16_main_grads(config: OptimizerConfig) -> bool:
    """--main-grads-dtype bf16 (precision-aware optimizer): a bf16 parameter's gradient
    accumulates and is reduced in bf16, as Megatron's grad buffer without
    --accumulate-allreduce-grads-in-fp32."""
    return config.use_precision_aware_optimizer and config.main_grads_dtype == "bf16"


def main_grad_dtype(param: torch.Tensor, bf16_grads: bool) -> torch.dtype:
    """The dtype `param`'s gradient accumulates in: fp32, or bf16 under bf16_main_grads."""
    return torch.bfloat16 if bf16_grads and param.dtype == torch.bfloat16 else torch.float32


def fp32_accumulate_hook(buf: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """Post-accumulate-grad hook: add the parameter's gradient to `buf` and free it. An fp32
    `buf` never rounds accumulation across micro-batches in the model dtype (a bf16 one,
    --main-grads-dtype bf16, does, as Megatron's)."""
    def hook(param: torch.Tensor) -> None:
        buf.add_(param.grad if param.grad.dtype == buf.dtype else param.grad.float())
        param.grad = None
    return hook
