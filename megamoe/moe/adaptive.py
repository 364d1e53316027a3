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

import time
from collections import Counter
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megamoe.moe.cost_model import CollectiveCosts, ModeCostInputs, predict_mode_seconds
from megamoe.moe.dispatcher import AllToAllTokenDispatcher
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


def gathered_expert_params(params: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """"dp": all E experts on every rank; the backward reduce-scatters (sums) the gradient
    of every expert onto the rank that owns it."""
    return {"fc1_weight": gather_from_sequence(params["fc1_weight"], group, reduce_grad=True),
            "fc2_weight": gather_from_sequence(params["fc2_weight"], group, reduce_grad=True)}


def hidden_sliced_expert_params(experts: torch.nn.Module, params: dict[str, torch.Tensor],
                                group) -> dict[str, torch.Tensor]:
    """"tp": slice s of F of every local expert goes to rank s, so each rank ends with its
    F slice of all E experts (global expert order: source rank major). fc1's SwiGLU columns
    [gate | up] are sliced block-wise so each rank keeps [gate slice | up slice]."""
    size = dist.get_world_size(group)
    local = experts.num_local_experts
    blocks = 2 if experts.swiglu else 1
    fc1, fc2 = params["fc1_weight"], params["fc2_weight"]  # [El, H, blocks F], [El, F, H]
    send1 = torch.cat([torch.cat([b.chunk(size, dim=-1)[s] for b in fc1.chunk(blocks, dim=-1)],
                                 dim=-1) for s in range(size)])  # [W El, H, blocks F / W]
    send2 = torch.cat(fc2.chunk(size, dim=1))  # [W El, F / W, H]
    splits = [local] * size
    return {"fc1_weight": all_to_all_uneven(send1, splits, splits, group),
            "fc2_weight": all_to_all_uneven(send2, splits, splits, group)}


class AdaptiveExpertParallel:
    """Executes one MoE layer's routed experts in the mode asked for, or, with `costs`,
    in the mode the cost model predicts fastest for this call's token count."""

    def __init__(self, layer: MoELayer, group, costs: Optional[CollectiveCosts] = None,
                 calibrate: bool = False) -> None:
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
        self.calibrate = calibrate
        self.timings: dict[int, dict[str, float]] = {}  # tokens -> measured seconds per mode
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
            dispatcher="alltoall" if isinstance(layer.token_dispatcher, AllToAllTokenDispatcher)
            else "allgather")

    def modes(self) -> tuple[str, ...]:
        return PARALLEL_MODES if self.tp_possible else ("ep", "dp")

    def choose(self, layer: MoELayer, num_tokens: int) -> str:
        """The fastest mode for `num_tokens` tokens per rank, decided once per token count
        and identical on every rank (agreed timings, same token count everywhere).

        With `calibrate`, each mode's forward + backward is timed on this layer's own
        weights with random tokens of that count (the slowest rank's time): the weights
        enter as detached leaves sharing their storage, so the probes' backward never
        reaches a parameter (no .grad, no gradient hook, no fp32 main grad, nothing the
        optimizer reads); nothing else is touched either. The alpha-beta model of
        cost_model.py misses what a step really pays per collective call and per expert
        group on a given machine. Without it the alpha-beta prediction decides."""
        if num_tokens not in self._choice:
            if self.calibrate:
                self._choice[num_tokens] = self._timed_choice(layer, num_tokens)
            elif self.costs is not None:
                seconds = predict_mode_seconds(self.costs, self.cost_inputs(layer, num_tokens))
                self._choice[num_tokens] = min(self.modes(), key=seconds.get)
            else:
                return "ep"
        return self._choice[num_tokens]

    def _timed_choice(self, layer: MoELayer, num_tokens: int, repeats: int = 2) -> str:
        experts = layer.experts
        dtype, device = experts.fc1_weight.dtype, experts.fc1_weight.device
        g = torch.Generator().manual_seed(1234 + dist.get_rank(self.group))
        x = torch.randn(num_tokens, layer.hidden_size, generator=g).to(device, dtype)
        logits = torch.randn(num_tokens, layer.config.num_experts, generator=g).to(device)
        top = logits.topk(layer.config.topk, dim=1).indices
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top, True)
        probs = torch.softmax(logits, dim=1) * routing_map
        # Leaves of their own on the parameters' storage: the probes' gradients stop here.
        probes = {name: p.detach().requires_grad_() for name, p in experts.named_parameters()}
        modes = self.modes()
        seconds = {m: float("inf") for m in modes}
        with torch.enable_grad():
            for i in range(1 + repeats):  # the first round warms up
                for mode in modes:
                    dist.barrier(group=self.group)
                    start = time.perf_counter()
                    out = self._run(layer, x.requires_grad_(), probs, routing_map, mode, probes)
                    out.sum().backward()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if i:
                        seconds[mode] = min(seconds[mode], time.perf_counter() - start)
        agreed = torch.tensor([seconds[m] for m in modes], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        self.timings[num_tokens] = dict(zip(modes, agreed.tolist()))
        return modes[int(agreed.argmin())]

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
        return self._run(layer, x_TH, probs_TE, routing_map_TE, mode)

    def _run(self, layer: MoELayer, x_TH: torch.Tensor, probs_TE: torch.Tensor,
             routing_map_TE: torch.Tensor, mode: str,
             params: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """One call in `mode`; `params` replaces the experts' parameters (calibration)."""
        own = dict(layer.experts.named_parameters()) if params is None else params
        if mode == "ep":
            def experts(*args):
                if params is None:
                    return layer.experts(*args)
                return torch.func.functional_call(layer.experts, params, args)

            return layer.token_dispatcher.forward(x_TH, probs_TE, routing_map_TE, experts)
        if mode == "dp":
            d = layer.dispatch(x_TH, probs_TE, routing_map_TE)
            return layer.combine(layer.compute(d, gathered_expert_params(own, self.group)), d)
        # "tp": every rank sees every token of the group, computes its F slice of all
        # experts; partial outputs (and, in backward, partial input gradients) are summed.
        x_GH = gather_from_sequence(x_TH, self.group, reduce_grad=True)
        probs_GE = gather_from_sequence(probs_TE, self.group, reduce_grad=True)
        map_GE = all_gather_no_grad(routing_map_TE, self.group)
        d = layer.dispatch(x_GH, probs_GE, map_GE)
        sliced = hidden_sliced_expert_params(layer.experts, own, self.group)
        return reduce_scatter_to_sequence(layer.combine(layer.compute(d, sliced), d),
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
    """'predicted ep 1.20 ms, ...; measured ep 3.1 ms, ... -> ep' for the first adaptive
    layer (a collective over its ep group when it calibrates: call it on every rank)."""
    from megamoe.moe.layer import MoELayer

    for layer in model.modules():
        if isinstance(layer, MoELayer) and layer.adaptive is not None:
            ex = layer.adaptive
            if ex.costs is None:
                return "no cost model (mode chosen per call)"
            seconds = predict_mode_seconds(ex.costs, ex.cost_inputs(layer, num_tokens))
            shown = ", ".join(f"{m} {1e3 * s:.2f} ms" for m, s in seconds.items())
            mode = ex.choose(layer, num_tokens)
            measured = ex.timings.get(num_tokens)
            if measured:
                shown += "; measured " + ", ".join(f"{m} {1e3 * s:.2f} ms"
                                                   for m, s in measured.items())
            return f"predicted {shown} -> {mode}"
    return "no expert-parallel MoE layer on this rank"


def enable_adaptive_parallelism(model: torch.nn.Module, group, *, measure: bool = True
                                ) -> list[AdaptiveExpertParallel]:
    """Give every expert-parallel MoE layer of `model` a switchable executor. With
    `measure`, time the collectives on `group` once (the alpha-beta model, logged) and let
    each layer time its modes at the first call of every token count and keep the fastest
    (see `choose`); otherwise the mode defaults to "ep" and callers pass `parallel_mode=` /
    `adaptive_r=`."""
    from megamoe.moe.layer import MoELayer

    costs = CollectiveCosts.measure(group) if measure else None
    executors = []
    for layer in [m for m in model.modules() if isinstance(m, MoELayer)]:
        layer.adaptive = AdaptiveExpertParallel(layer, group, costs, calibrate=measure)
        executors.append(layer.adaptive)
    return executors
