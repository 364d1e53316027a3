"""Top-k router: gate logits -> scores -> (group-limited) top-k -> combine probs + map.

Semantics follow Megatron-Core's `topk_routing_with_score_function`, so checkpoints and
loss curves carry over. Balancing losses are computed here (the router owns the logits)
and handed to the layer, which attaches them to its output.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from megamoe.config import MoEConfig
from megamoe.moe.losses import (
    MoELossTracker,
    attach_aux_loss,
    switch_load_balancing_loss,
    z_loss,
)

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _group_limited_topk(scores_TE: torch.Tensor, topk: int, num_groups: int,
                        group_topk: int) -> torch.Tensor:
    """Top-k indices restricted to the `group_topk` best groups (DeepSeek-V3 node limit).

    A group's score is the sum of its top (topk / group_topk) expert scores.
    """
    num_tokens, num_experts = scores_TE.shape
    scores_TGe = scores_TE.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores_TG = scores_TGe.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    group_idx = group_scores_TG.topk(group_topk, dim=-1, sorted=False).indices
    group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    group_mask_TG.scatter_(1, group_idx, True)
    expert_mask_TE = group_mask_TG.unsqueeze(-1).expand_as(scores_TGe).reshape(num_tokens, -1)
    masked_TE = scores_TE.masked_fill(~expert_mask_TE, float("-inf"))
    return masked_TE.topk(topk, dim=-1).indices


def _select(scores_TE: torch.Tensor, topk: int, num_groups: Optional[int],
            group_topk: Optional[int], expert_bias: Optional[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(unbiased selected scores [T, k], indices [T, k]); the bias only steers selection."""
    sel_TE = scores_TE if expert_bias is None else scores_TE + expert_bias.to(scores_TE.dtype)
    if num_groups is not None and group_topk is not None:
        idx_Tk = _group_limited_topk(sel_TE, topk, num_groups, group_topk)
    else:
        idx_Tk = sel_TE.topk(topk, dim=-1).indices
    return scores_TE.gather(1, idx_Tk), idx_Tk


def topk_routing(logits_TE: torch.Tensor, topk: int, *, score_function: str = "softmax",
                 pre_softmax: bool = False, num_groups: Optional[int] = None,
                 group_topk: Optional[int] = None, scaling_factor: Optional[float] = None,
                 expert_bias: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens: returns (probs_TE with zeros off the map, routing_map_TE bool)."""
    if score_function == "softmax":
        if pre_softmax:
            scores_TE = torch.softmax(logits_TE, dim=-1)
            probs_Tk, idx_Tk = _select(scores_TE, topk, num_groups, group_topk, expert_bias)
        else:
            top_logits_Tk, idx_Tk = _select(logits_TE, topk, num_groups, group_topk,
                                            expert_bias)
            probs_Tk = torch.softmax(top_logits_Tk, dim=-1)
    elif score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        probs_Tk, idx_Tk = _select(scores_TE, topk, num_groups, group_topk, expert_bias)
        if topk > 1:
            probs_Tk = probs_Tk / (probs_Tk.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown router score function {score_function!r}")
    if scaling_factor is not None:
        probs_Tk = probs_Tk * scaling_factor
    probs_TE = torch.zeros_like(logits_TE).scatter(1, idx_Tk, probs_Tk)
    routing_map_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, idx_Tk, True)
    return probs_TE, routing_map_TE


def scores_for_aux_loss(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """Full per-expert probabilities P used by the load-balancing loss."""
    if score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.softmax(logits_TE, dim=-1)


class RouterOutput(NamedTuple):
    probs_TE: torch.Tensor  # combine weights, zero off the routing map (router dtype)
    routing_map_TE: torch.Tensor  # bool
    aux_loss: Optional[torch.Tensor]  # weighted sum of balancing losses, None if none


class TopKRouter(nn.Module):
    """Linear gate in fp32/fp64 + top-k routing + balancing losses."""

    def __init__(self, hidden_size: int, config: MoEConfig, layer_number: int,
                 num_layers: int, init_method_std: float) -> None:
        super().__init__()
        for kind in config.load_balancing_types:
            if kind not in ("aux_loss", "none"):
                raise ValueError(f"--moe-router-load-balancing-type {kind} is not supported")
        if config.router_dtype not in _ROUTER_DTYPES:
            raise ValueError(f"--moe-router-dtype must be fp32 or fp64, "
                             f"got {config.router_dtype!r}")
        self.config = config
        self.layer_number = layer_number
        self.num_layers = num_layers
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size,
                                               dtype=torch.float32))
        nn.init.normal_(self.weight, mean=0.0, std=init_method_std)

    def gating(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Logits in the router dtype whatever the activations' dtype (routing is fragile)."""
        dtype = _ROUTER_DTYPES[self.config.router_dtype]
        return torch.nn.functional.linear(x_TH.to(dtype), self.weight.to(dtype))

    def route(self, x_TH: torch.Tensor) -> RouterOutput:
        """Routing plus the (unattached) balancing loss; the MoE layer attaches it."""
        cfg = self.config
        logits_TE = self.gating(x_TH)
        probs_TE, routing_map_TE = topk_routing(
            logits_TE, cfg.topk, score_function=cfg.score_function,
            pre_softmax=cfg.pre_softmax, num_groups=cfg.num_groups,
            group_topk=cfg.group_topk, scaling_factor=cfg.topk_scaling_factor)
        aux_loss = None
        if self.training and torch.is_grad_enabled():
            aux_loss = self._balancing_losses(logits_TE, routing_map_TE)
        return RouterOutput(probs_TE, routing_map_TE, aux_loss)

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs_TE, routing_map_TE); balancing losses ride on probs' backward."""
        probs_TE, routing_map_TE, aux_loss = self.route(x_TH)
        if aux_loss is not None:
            probs_TE = attach_aux_loss(probs_TE, aux_loss)
        return probs_TE, routing_map_TE

    def _balancing_losses(self, logits_TE: torch.Tensor,
                          routing_map_TE: torch.Tensor) -> Optional[torch.Tensor]:
        """Sum of enabled losses; each recorded per layer as loss / coeff for logging."""
        cfg = self.config
        total = None
        aux_coeff = cfg.aux_loss_coeff("aux_loss")
        if aux_coeff > 0:
            probs_TE = scores_for_aux_loss(logits_TE, cfg.score_function)
            lb = switch_load_balancing_loss(probs_TE, routing_map_TE.sum(dim=0), cfg.topk, 1.0)
            MoELossTracker.record("load_balancing_loss", self.layer_number, self.num_layers, lb)
            total = aux_coeff * lb
        if cfg.z_loss_coeff is not None and cfg.z_loss_coeff > 0:
            z = z_loss(logits_TE, 1.0)
            MoELossTracker.record("z_loss", self.layer_number, self.num_layers, z)
            total = cfg.z_loss_coeff * z if total is None else total + cfg.z_loss_coeff * z
        return total
