"""Routers: gate logits -> scores -> (group-limited / biased / sinkhorn) top-k, or expert
choice -> combine probs + routing map.

Semantics follow Megatron-Core's `topk_routing_with_score_function` and its sinkhorn
router, so checkpoints and loss curves carry over. Balancing losses are computed here (the
router owns the logits) and handed to the layer, which attaches them to its output.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megamoe.config import MoEConfig
from megamoe.moe.force_balance import random_logits
from megamoe.moe.losses import (
    MoELossTracker,
    attach_aux_loss,
    global_load_balancing_loss,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    z_loss,
)
from megamoe.parallel.checkpointing import is_recomputing, replay_once
from megamoe.parallel.rng import RNGTracker

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
    def choose() -> torch.Tensor:
        sel_TE = scores_TE.detach() if expert_bias is None else (
            scores_TE.detach() + expert_bias.to(scores_TE.dtype))
        if num_groups is not None and group_topk is not None:
            return _group_limited_topk(sel_TE, topk, num_groups, group_topk)
        return sel_TE.topk(topk, dim=-1).indices

    idx_Tk = replay_once(choose)  # a recompute replay reuses the forward's choice
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


def sinkhorn(cost_TE: torch.Tensor, tol: float = 1e-4, max_iters: int = 10000) -> torch.Tensor:
    """Doubly-normalise exp(cost): rows sum to 1/T, columns to 1/E (Sinkhorn-Knopp).

    The cost is shifted by its maximum first (exp overflows otherwise); the shift is a
    constant factor that the row/column scalings absorb, so the fixed point is unchanged.
    """
    cost_TE = torch.exp(cost_TE - cost_TE.max())
    num_tokens, num_experts = cost_TE.shape
    d0_T = cost_TE.new_ones(num_tokens)
    d1_E = cost_TE.new_ones(num_experts)
    eps = 1e-8
    for _ in range(max_iters):
        d0_T = (1.0 / num_tokens) / ((d1_E * cost_TE).sum(dim=1) + eps)
        d1_new_E = (1.0 / num_experts) / ((d0_T.unsqueeze(1) * cost_TE).sum(dim=0) + eps)
        err = (d1_new_E - d1_E).abs().mean()
        d1_E = d1_new_E
        if err <= tol * d1_E.abs().mean():
            break
    return d1_E * cost_TE * d0_T.unsqueeze(1)


def sinkhorn_routing(logits_TE: torch.Tensor, topk: int, training: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """S-BASE: in training select top-k of the sinkhorn-balanced scores; the combine
    weights are always the raw scores (sigmoid for k = 1, softmax otherwise), masked."""
    scores_TE = torch.sigmoid(logits_TE) if topk == 1 else torch.softmax(logits_TE, dim=-1)
    if training:
        idx_Tk = replay_once(lambda: sinkhorn(logits_TE.detach().to(torch.float32))
                             .topk(topk, dim=1).indices)
    else:
        idx_Tk = scores_TE.detach().topk(topk, dim=1).indices
    routing_map_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, idx_Tk, True)
    return scores_TE * routing_map_TE, routing_map_TE


def expert_choice_capacity(num_tokens: int, num_experts: int, topk: int,
                           capacity_factor: Optional[float]) -> int:
    """Tokens each expert takes: capacity_factor (default 1) x k x T / E, at most T."""
    cf = 1.0 if capacity_factor is None else capacity_factor
    return max(1, min(num_tokens, math.ceil(cf * topk * num_tokens / num_experts)))


def expert_choice_routing(logits_TE: torch.Tensor, capacity: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert choice (Zhou et al. 2022): each expert takes its `capacity` highest-scoring
    tokens; a token may get 0..E experts; combine weight = its softmax score."""
    scores_TE = torch.softmax(logits_TE, dim=-1)
    idx_CE = replay_once(lambda: scores_TE.detach().topk(capacity, dim=0).indices)
    routing_map_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(0, idx_CE, True)
    return scores_TE * routing_map_TE, routing_map_TE


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
    """Linear gate in fp32/fp64 + routing + balancing losses + aux-loss-free expert bias.

    `balancing_group` is the tp-dp-cp group over which global_aux_loss counts are summed
    (None = this process only); `grad_average_size` the number of ranks whose gradients
    are averaged (dp x cp), which the global loss compensates for.
    """

    def __init__(self, hidden_size: int, config: MoEConfig, layer_number: int,
                 num_layers: int, init_method_std: float, *,
                 balancing_group: Optional[dist.ProcessGroup] = None,
                 grad_average_size: int = 1) -> None:
        super().__init__()
        self.sinkhorn = "sinkhorn" in config.load_balancing_types
        self.config = config
        self.layer_number = layer_number
        self.num_layers = num_layers
        self.balancing_group = balancing_group
        self.grad_average_size = grad_average_size
        # Context parallelism (parallelize sets it): aux_loss / seq_aux_loss sum their
        # token counts over the cp group, so each token counts once in the sequence's loss.
        self.cp_group: Optional[dist.ProcessGroup] = None
        self.cp_size = 1
        # --moe-router-force-load-balancing: this rank's noise stream (parallelize sets
        # it; None draws from the default generator).
        self.force_rng: Optional[RNGTracker] = None
        self.init_stds = {"weight": init_method_std}
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size,
                                               dtype=torch.float32))
        nn.init.normal_(self.weight, mean=0.0, std=init_method_std)
        num_experts = config.num_experts
        # global_aux_loss: routed tokens per expert and tokens, summed over the group and
        # over the micro-batches of the current global batch (reset by the schedule).
        # Integer counts: exact, and untouched by model.to(bf16).
        self.register_buffer("global_tokens_per_expert",
                             torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("global_num_tokens", torch.zeros((), dtype=torch.long),
                             persistent=False)
        self.expert_bias: Optional[torch.Tensor]
        if config.enable_expert_bias:
            # Saved with the model (it is learned state); counts are per global batch.
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(num_experts, dtype=torch.long), persistent=False)
        else:
            self.expert_bias = None

    def _apply(self, fn, recurse=True):
        """model.to(bf16) must not round the expert bias: it stays fp32 (as Megatron)."""
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = bias.to(device=self.expert_bias.device, dtype=torch.float32)
        return self

    def gating(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Logits in the router dtype whatever the activations' dtype (routing is fragile)."""
        dtype = _ROUTER_DTYPES[self.config.router_dtype]
        return torch.nn.functional.linear(x_TH.to(dtype), self.weight.to(dtype))

    def apply_input_jitter(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Multiplicative uniform noise in [1 - eps, 1 + eps] on the router input (training)."""
        eps = self.config.input_jitter_eps
        if not self.training or eps is None or eps == 0:
            return x_TH
        noise = torch.empty_like(x_TH).uniform_(1.0 - eps, 1.0 + eps)
        return x_TH * noise

    def routing(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        if cfg.router_type == "expert_choice":
            cap = expert_choice_capacity(logits_TE.shape[0], cfg.num_experts, cfg.topk,
                                         cfg.capacity_factor)
            return expert_choice_routing(logits_TE, cap)
        if self.sinkhorn:
            return sinkhorn_routing(logits_TE, cfg.topk, self.training)
        return topk_routing(
            logits_TE, cfg.topk, score_function=cfg.score_function,
            pre_softmax=cfg.pre_softmax, num_groups=cfg.num_groups,
            group_topk=cfg.group_topk, scaling_factor=cfg.topk_scaling_factor,
            expert_bias=self.expert_bias)

    def route(self, x_TH: torch.Tensor, seq_ids_T: Optional[torch.Tensor] = None,
              num_seqs: int = 1, *, count_expert_bias: bool = True) -> RouterOutput:
        """Routing plus the (unattached) balancing loss; the MoE layer attaches it.

        `seq_ids_T` (token -> sequence index, `num_seqs` sequences) is needed only by
        seq_aux_loss; None means one sequence. `count_expert_bias=False`: the caller counts
        the assignments for the expert-bias update itself (the MoE layer: after capacity).
        """
        logits_TE = self.gating(self.apply_input_jitter(x_TH))
        if self.config.force_load_balancing:
            logits_TE = random_logits(logits_TE, self.force_rng)
        probs_TE, routing_map_TE = self.routing(logits_TE)
        aux_loss = None
        if self.training and torch.is_grad_enabled():
            if count_expert_bias:
                self.count_for_expert_bias(routing_map_TE.sum(dim=0))
            aux_loss = self._balancing_losses(logits_TE, routing_map_TE, seq_ids_T, num_seqs)
        return RouterOutput(probs_TE, routing_map_TE, aux_loss)

    def count_for_expert_bias(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Add assignments per expert to the next expert-bias update (training forwards
        with gradients only: not evaluation, not recomputation)."""
        if (self.expert_bias is not None and self.training and torch.is_grad_enabled()
                and not is_recomputing()):
            self.local_tokens_per_expert += tokens_per_expert_E

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs_TE, routing_map_TE); balancing losses ride on probs' backward."""
        probs_TE, routing_map_TE, aux_loss = self.route(x_TH)
        if aux_loss is not None:
            probs_TE = attach_aux_loss(probs_TE, aux_loss)
        return probs_TE, routing_map_TE

    def reset_global_batch_state(self) -> None:
        """Start a new global batch for global_aux_loss (called by the schedule)."""
        self.global_tokens_per_expert.zero_()
        self.global_num_tokens.zero_()

    @torch.no_grad()
    def update_expert_bias(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        """bias += rate * sign(mean(count) - count) over the global batch's token counts,
        summed over `process_group` (tp-dp-cp); then the counts restart from zero."""
        if self.expert_bias is None:
            return
        counts_E = self.local_tokens_per_expert.clone()
        if process_group is not None:
            dist.all_reduce(counts_E, group=process_group)
        counts_E = counts_E.to(torch.float64)
        step_E = torch.sign(counts_E.mean() - counts_E).to(self.expert_bias.dtype)
        self.expert_bias += self.config.bias_update_rate * step_E
        self.local_tokens_per_expert.zero_()

    def _global_fraction(self, routing_map_TE: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update the running global counts; (fraction per expert, this micro-batch's tokens
        over the group, a 0-d tensor left on the device: no host sync)."""
        stats = torch.cat([routing_map_TE.sum(dim=0),  # a fill, not a host->device copy
                           torch.full((1,), routing_map_TE.shape[0], dtype=torch.long,
                                      device=routing_map_TE.device)])
        if self.balancing_group is not None:
            dist.all_reduce(stats, group=self.balancing_group)
        self.global_tokens_per_expert += stats[:-1]
        self.global_num_tokens += stats[-1]
        fraction_E = self.global_tokens_per_expert.double() / self.global_num_tokens.double()
        return fraction_E, stats[-1]

    def _sum_over_cp(self, counts: torch.Tensor) -> torch.Tensor:
        """Token counts summed over the cp group (a recompute replay reuses the sum)."""
        if self.cp_group is None:
            return counts

        def reduce() -> torch.Tensor:
            total = counts.detach().clone()
            dist.all_reduce(total, group=self.cp_group)
            return total
        return replay_once(reduce)

    def _balancing_losses(self, logits_TE: torch.Tensor, routing_map_TE: torch.Tensor,
                          seq_ids_T: Optional[torch.Tensor], num_seqs: int
                          ) -> Optional[torch.Tensor]:
        """Sum of enabled losses; each recorded per layer as loss / coeff for logging."""
        cfg = self.config
        terms = []

        def add(name: str, coeff: float, value: torch.Tensor) -> None:
            if not is_recomputing():  # logged once per real forward
                MoELossTracker.record(name, self.layer_number, self.num_layers, value)
            terms.append(coeff * value)

        probs_TE = None
        for kind, name in (("aux_loss", "load_balancing_loss"),
                           ("seq_aux_loss", "seq_load_balancing_loss"),
                           ("global_aux_loss", "global_load_balancing_loss")):
            coeff = cfg.aux_loss_coeff(kind)
            if coeff <= 0:
                continue
            if probs_TE is None:
                probs_TE = scores_for_aux_loss(logits_TE, cfg.score_function)
            if kind == "aux_loss":
                value = switch_load_balancing_loss(
                    probs_TE, self._sum_over_cp(routing_map_TE.sum(dim=0)), cfg.topk, 1.0,
                    self.cp_size)
            elif kind == "seq_aux_loss":
                if seq_ids_T is None:
                    seq_ids_T = torch.zeros(len(logits_TE), dtype=torch.long,
                                            device=logits_TE.device)
                value = sequence_load_balancing_loss(
                    probs_TE, routing_map_TE, seq_ids_T, num_seqs, cfg.topk, 1.0,
                    self.cp_size, self._sum_over_cp)
            else:
                # The running counts advance once per real forward; a replay reuses them.
                fraction_E, group_tokens = replay_once(
                    lambda: self._global_fraction(routing_map_TE))
                value = global_load_balancing_loss(probs_TE, fraction_E, group_tokens,
                                                   cfg.topk, 1.0, self.grad_average_size)
            add(name, coeff, value)
        if cfg.z_loss_coeff is not None and cfg.z_loss_coeff > 0:
            add("z_loss", cfg.z_loss_coeff, z_loss(logits_TE, 1.0))
        if not terms:
            return None
        return torch.stack(terms).sum()
