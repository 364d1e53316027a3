"""Switchable expert parallelism at run time (Tutel's adaptive_r).

The experts stay stored as expert parallelism lays them out: rank r of the ep group (size
W) owns the E / W whole experts [r E/W, (r+1) E/W). Each forward may execute as

  "ep"  tokens travel to the experts: the layer's token dispatcher (all-to-all or
        all-gather), as a fixed EP layout does. Traffic ~ tokens x k x H.
  "dp"  experts travel to the tokens: every rank all-gathers all E experts' weights just in
        time and runs its own tokens through them (no token moves); the backward
        reduce-scatters the weight gradients back to the owning ranks (FSDP's pattern).
        Traffic ~ expert weight bytes, independent of the number of tokens.
  "tp"  both half-way: the weights are re-sliced by an all-to-all so that every rank holds
        1/W of the hidden dimension F of *every* expert, the tokens are all-gathered, each
        rank computes its F slice for all tokens and the partial outputs are
        reduce-scattered (Tutel's r = W/E "MP" split, our expert tensor parallelism).

Tutel's adaptive_r maps onto these: r = 0 -> "dp", r = 1 -> "ep", r = W -> "tp". All modes
compute the same sums (only their order differs), the gradients land on the owning shard,
so stored weights, optimizer states and checkpoints never depend on the mode. Which mode is
cheapest depends on tokens per step against expert weight bytes and on the links:
`cost_model.py` predicts it from measured collective timings.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megamoe.moe.cost_model import CollectiveCosts, ModeCostInputs, predict_mode_seconds
from megamoe.parallel.comm import (
    all_gather_no_grad,
    all_to_all_uneven,
    gather_from_sequence,
    reduce_scatter_to_sequence,
)

if TYPE_CHECKING:
    from megamoe.moe.layer import MoELayer

PARALLEL_MODES = ("ep", "dp", "tp")


def mode_from_adaptive_r(r: int, ep_size: int) -> str:
    """Tutel's adaptive_r -> mode name (0 = data, 1 = expert, W = expert + tensor)."""
    if r == 0:
        return "dp"
    if r == 1:
        return "ep"
    if r == ep_size:
        return "tp"
    raise ValueError(f"adaptive_r must be 0 (dp), 1 (ep) or the expert-parallel size "
                     f"{ep_size} (tp), got {r}")


def gathered_expert_params(experts: torch.nn.Module, group) -> dict[str, torch.Tensor]:
    """"dp": all E experts on every rank; the backward reduce-scatters (sums) the gradient
    of every expert onto the rank that owns it."""
    return {"fc1_weight": gather_from_sequence(experts.fc1_weight, group, reduce_grad=True),
            "fc2_weight": gather_from_sequence(experts.fc2_weight, group, reduce_grad=True)}


def hidden_sliced_expert_params(experts: torch.nn.Module, group) -> dict[str, torch.Tensor]:
    """"tp": slice s of F of every local expert goes to rank s, so each rank ends with its
    F slice of all E experts (global expert order: source rank major). fc1's SwiGLU columns
    [gate | up] are sliced block-wise so each rank keeps [gate slice | up slice]."""
    size = dist.get_world_size(group)
    local = experts.num_local_experts
    blocks = 2 if experts.swiglu else 1
    fc1, fc2 = experts.fc1_weight, experts.fc2_weight  # [El, H, blocks F], [El, F, H]
    send1 = torch.cat([torch.cat([b.chunk(size, dim=-1)[s] for b in fc1.chunk(blocks, dim=-1)],
                                 dim=-1) for s in range(size)])  # [W El, H, blocks F / W]
    send2 = torch.cat(fc2.chunk(size, dim=1))  # [W El, F / W, H]
    splits = [local] * size
    return {"fc1_weight": all_to_all_uneven(send1, splits, splits, group),
            "fc2_weight": all_to_all_uneven(send2, splits, splits, group)}


class AdaptiveExpertParallel:
    """Executes one MoE layer's routed experts in the mode asked for, or, with `costs`,
    in the mode the cost model predicts fastest for this call's token count."""

    def __init__(self, layer: MoELayer, group, costs: Optional[CollectiveCosts] = None
                 ) -> None:
        experts = layer.experts
        if layer.token_dispatcher is None:
            raise ValueError("--moe-adaptive-parallelism needs --expert-model-parallel-size > 1")
        if experts.fc1_bias is not None or experts.fc2_bias is not None:
            raise ValueError("not supported yet: --moe-adaptive-parallelism with expert biases "
                             "(add --disable-bias-linear)")
        if getattr(experts, "etp_size", 1) > 1:
            raise ValueError("not supported yet: --moe-adaptive-parallelism with "
                             "--expert-tensor-parallel-size > 1")
        self.group = group
        self.size = dist.get_world_size(group)
        ffn = experts.fc2_weight.shape[1]
        self.tp_possible = ffn % self.size == 0
        self.costs = costs
        self.mode_counts: Counter = Counter()
        self.last_mode: Optional[str] = None
        self._choice: dict[int, str] = {}  # tokens per rank -> chosen mode (deterministic)

    def cost_inputs(self, layer: MoELayer, num_tokens: int) -> ModeCostInputs:
        experts = layer.experts
        return ModeCostInputs(
            tokens=num_tokens, hidden=layer.hidden_size, topk=layer.config.topk,
            num_experts=layer.config.num_experts, ep_size=self.size,
            local_expert_numel=sum(p.numel() for p in experts.parameters()),
            bytes_per_element=experts.fc1_weight.element_size(),
            dispatcher=layer.config.token_dispatcher_type)

    def choose(self, layer: MoELayer, num_tokens: int) -> str:
        """The predicted-fastest mode; every rank computes the same answer (the costs were
        agreed on by all ranks and the token count is the same on all of them)."""
        if self.costs is None:
            return "ep"
        if num_tokens not in self._choice:
            seconds = predict_mode_seconds(self.costs, self.cost_inputs(layer, num_tokens))
            if not self.tp_possible:
                seconds.pop("tp")
            self._choice[num_tokens] = min(seconds, key=seconds.get)
        return self._choice[num_tokens]

    def forward(self, layer: MoELayer, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                routing_map_TE: torch.Tensor, mode: Optional[str] = None) -> torch.Tensor:
        mode = mode or self.choose(layer, x_TH.shape[0])
        if mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be one of {PARALLEL_MODES}, got {mode!r}")
        if mode == "tp" and not self.tp_possible:
            raise ValueError(f"parallel_mode 'tp' needs the expert hidden size "
                             f"({layer.experts.fc2_weight.shape[1]}) divisible by the "
                             f"expert-parallel size ({self.size})")
        self.last_mode = mode
        if layer.training:
            self.mode_counts[mode] += 1
        if mode == "ep":
            return layer.token_dispatcher.forward(x_TH, probs_TE, routing_map_TE, layer.experts)
        if mode == "dp":
            d = layer.dispatch(x_TH, probs_TE, routing_map_TE)
            return layer.combine(layer.compute(d, gathered_expert_params(layer.experts,
                                                                         self.group)), d)
        # "tp": every rank sees every token of the group, computes its F slice of all
        # experts; partial outputs (and, in backward, partial input gradients) are summed.
        x_GH = gather_from_sequence(x_TH, self.group, reduce_grad=True)
        probs_GE = gather_from_sequence(probs_TE, self.group, reduce_grad=True)
        map_GE = all_gather_no_grad(routing_map_TE, self.group)
        d = layer.dispatch(x_GH, probs_GE, map_GE)
        params = hidden_sliced_expert_params(layer.experts, self.group)
        return reduce_scatter_to_sequence(layer.combine(layer.compute(d, params), d),
                                          self.group)


def mode_counts(model: torch.nn.Module, reset: bool = True) -> Counter:
    """Training calls per mode over all MoE layers since the last read (for the logger)."""
    total: Counter = Counter()
    for module in model.modules():
        adaptive = getattr(module, "adaptive", None)
        if isinstance(adaptive, AdaptiveExpertParallel):
            total.update(adaptive.mode_counts)
            if reset:
                adaptive.mode_counts.clear()
    return total


def describe_choice(model: torch.nn.Module, num_tokens: int) -> str:
    """'ep 1.20 ms, dp 0.31 ms, tp 0.90 ms -> dp' for the first adaptive layer."""
    from megamoe.moe.layer import MoELayer

    for layer in model.modules():
        if isinstance(layer, MoELayer) and layer.adaptive is not None:
            ex = layer.adaptive
            if ex.costs is None:
                return "no cost model (mode chosen per call)"
            seconds = predict_mode_seconds(ex.costs, ex.cost_inputs(layer, num_tokens))
            shown = ", ".join(f"{m} {1e3 * s:.2f} ms" for m, s in seconds.items())
            return f"predicted {shown} -> {ex.choose(layer, num_tokens)}"
    return "no expert-parallel MoE layer on this rank"


def enable_adaptive_parallelism(model: torch.nn.Module, group, *, measure: bool = True
                                ) -> list[AdaptiveExpertParallel]:
    """Give every expert-parallel MoE layer of `model` a switchable executor. With
    `measure`, time the collectives on `group` once (agreed on by all ranks) and let the
    cost model choose the mode per layer and call; otherwise the mode defaults to "ep" and
    callers pass `parallel_mode=` / `adaptive_r=`."""
    from megamoe.moe.layer import MoELayer

    costs = CollectiveCosts.measure(group) if measure else None
    executors = []
    for layer in [m for m in model.modules() if isinstance(m, MoELayer)]:
        layer.adaptive = AdaptiveExpertParallel(layer, group, costs)
        executors.append(layer.adaptive)
    return executors
