"""Turn dense models into MoE models (FastMoE's `fmoefy`) and upcycle dense weights.

`moefy(model, num_experts=..., topk=...)` swaps MLPs for `MoELayer`s in place:
  - our GPTModel's `MLP`s become grouped-expert MoE layers (and the model's config says so);
  - any module matching a user `predicate(name, module)` becomes a MoE layer whose experts
    are copies of that module (or whatever a user `factory(name, module, index)` builds).
Upcycling (Komatsuzaki et al. 2022, --moe-use-upcycling): every expert starts as a copy
of the dense MLP. With softmax top-k probabilities that sum to 1 (the default router), the
MoE layer then computes exactly the dense MLP, so the converted model's first loss equals
the dense model's.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

from megamoe.config import MoEConfig
from megamoe.model.mlp import MLP
from megamoe.moe.experts import GroupedExperts
from megamoe.moe.layer import MoELayer

Predicate = Callable[[str, nn.Module], bool]
Factory = Callable[[str, nn.Module, int], nn.Module]


@torch.no_grad()
def upcycle_mlp(mlp: nn.Module, moe: MoELayer) -> None:
    """Copy a dense Megatron MLP (linear_fc1 [F or 2F, H], linear_fc2 [H, F]) into every
    expert of `moe` (fc1 [E, H, F or 2F], fc2 [E, F, H])."""
    experts = moe.experts
    if not isinstance(experts, GroupedExperts):
        for expert in experts.local_experts:
            expert.load_state_dict(mlp.state_dict())
        return
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    if experts.fc1_weight.shape[1:] != fc1.weight.t().shape or \
            experts.fc2_weight.shape[1:] != fc2.weight.t().shape:
        raise ValueError(f"upcycling: dense MLP {tuple(fc1.weight.shape)}/"
                         f"{tuple(fc2.weight.shape)} does not match experts "
                         f"{tuple(experts.fc1_weight.shape)}/{tuple(experts.fc2_weight.shape)}")
    experts.fc1_weight.copy_(fc1.weight.t().unsqueeze(0).expand_as(experts.fc1_weight))
    experts.fc2_weight.copy_(fc2.weight.t().unsqueeze(0).expand_as(experts.fc2_weight))
    for name, dense_bias in (("fc1_bias", fc1.bias), ("fc2_bias", fc2.bias)):
        bias = getattr(experts, name)
        if (bias is None) != (dense_bias is None):
            raise ValueError(f"upcycling: {name} present in only one of dense/MoE models")
        if bias is not None:
            bias.copy_(dense_bias.unsqueeze(0).expand_as(bias))


@torch.no_grad()
def upcycle_model(dense: nn.Module, moe_model: nn.Module) -> None:
    """Initialise `moe_model` from `dense` (same architecture except MLP -> MoE): shared
    parameters are copied by name, every MoE layer's experts from the dense MLP at the
    same path. The routers keep their own initialisation."""
    dense_modules = dict(dense.named_modules())
    dense_state = dense.state_dict()
    moe_state = moe_model.state_dict()
    for name, tensor in moe_state.items():
        if name in dense_state and dense_state[name].shape == tensor.shape:
            tensor.copy_(dense_state[name])
    for name, module in moe_model.named_modules():
        if isinstance(module, MoELayer):
            if name not in dense_modules:
                raise ValueError(f"upcycling: the dense model has no module {name!r}")
            upcycle_mlp(dense_modules[name], module)


def _is_megamoe_mlp(name: str, module: nn.Module) -> bool:
    return isinstance(module, MLP)


def _hidden_size(module: nn.Module) -> int:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            return m.in_features
        if hasattr(m, "in_features"):
            return int(m.in_features)
    raise ValueError(f"moefy: cannot infer hidden_size of {type(module).__name__}; "
                     "pass hidden_size=")


def moefy(model: nn.Module, *, num_experts: int, topk: int = 2,
          predicate: Optional[Predicate] = None, factory: Optional[Factory] = None,
          upcycle: bool = True, hidden_size: Optional[int] = None,
          **moe_options) -> nn.Module:
    """Replace matching MLPs of `model` with MoE layers, in place; returns `model`.

    predicate(name, module) picks modules (default: megamoe's dense `MLP`); factory(name,
    module, index) builds the replacement (default: a MoELayer — grouped experts for a
    megamoe MLP, otherwise `num_experts` copies of the module as experts). With `upcycle`
    the experts start as copies of the dense weights, otherwise they are re-initialised.
    `moe_options` are further MoEConfig fields (score_function, aux_loss_coeffs, ...).
    """
    pred = predicate or _is_megamoe_mlp
    targets = [(n, m) for n, m in model.named_modules() if n and pred(n, m)]
    if not targets:
        raise ValueError("moefy: no module matched the predicate")
    config = getattr(model, "config", None)
    std = getattr(config, "init_method_std", 0.02)
    moe_cfg = None
    for index, (name, module) in enumerate(targets):
        if factory is not None:
            new = factory(name, module, index)
        elif _is_megamoe_mlp(name, module):
            fc1 = module.linear_fc1
            ffn = fc1.out_features // (2 if module.gated else 1)
            moe_cfg = MoEConfig(num_experts=num_experts, topk=topk, ffn_hidden_size=ffn,
                                **moe_options)
            new = MoELayer(moe_cfg, fc1.in_features, layer_number=index,
                           num_layers=len(targets), init_method_std=std,
                           add_bias_linear=fc1.bias is not None, swiglu=module.swiglu,
                           activation=module.activation, grouped_gemm=True)
            if upcycle:
                upcycle_mlp(module, new)
        else:
            experts = [copy.deepcopy(module) for _ in range(num_experts)]
            if not upcycle:
                for expert in experts:
                    for m in expert.modules():
                        if hasattr(m, "reset_parameters"):
                            m.reset_parameters()
            new = MoELayer(None, hidden_size or _hidden_size(module), layer_number=index,
                           num_layers=len(targets), init_method_std=std, experts=experts,
                           topk=topk, **moe_options)
        new.to(next(module.parameters()).device)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if moe_cfg is not None and dataclasses.is_dataclass(config) and hasattr(config, "moe"):
        # Keep our GPTModel's config truthful (FLOPs, checkpoints, conversion read it).
        pattern = [1 if f"decoder.layers.{i}.mlp" in dict(targets) else 0
                   for i in range(config.num_layers)]
        model.config = dataclasses.replace(config, moe=moe_cfg, moe_layer_pattern=pattern)
    return model
