"""Switchable expert parallelism at run time (Tutel's adaptive_r), as a dispatcher that
wraps the layer's expert-parallel one.

The experts stay stored as expert parallelism lays them out: rank r of the ep group (size
W) owns the E / W whole experts [r E/W, (r+1) E/W). Each call may execute as

  "ep"  tokens travel to the experts: the wrapped dispatcher (all-to-all or all-gather),
        as a fixed EP layout does. Traffic ~ tokens x k x H.
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
cheapest depends on tokens per step against expert weight bytes and on the links: each
mode is timed once per token count on the layer's own weights (`calibrate`), next to the
alpha-beta prediction of cost_model.py.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Optional

import torch
import torch.distributed as dist

from megamoe.moe.cost_model import CollectiveCosts, ModeCostInputs, predict_mode_seconds
from megamoe.moe.dispatchers.alltoall import AllToAllDispatcher
from megamoe.moe.dispatchers.base import Experts, TokenDispatcher
from megamoe.moe.dispatchers.expert_parallel import ExpertParallelDispatcher
from megamoe.moe.dispatchers.local import LocalDispatcher
from megamoe.parallel.checkpointing import is_recomputing
from megamoe.parallel.comm import (
    all_gather_no_grad,
    all_to_all_uneven,
    gather_from_sequence,
    reduce_scatter_to_sequence,
)

PARALLEL_MODES = ("ep", "dp", "tp")
Params = dict[str, torch.Tensor]


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


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


def gathered_expert_params(params: Params, group) -> Params:
    """"dp": all E experts on every rank; the backward reduce-scatters (sums) the gradient
    of every expert onto the rank that owns it."""
    return {"fc1_weight": gather_from_sequence(params["fc1_weight"], group, reduce_grad=True),
            "fc2_weight": gather_from_sequence(params["fc2_weight"], group, reduce_grad=True)}


def hidden_sliced_expert_params(experts: torch.nn.Module, params: Params, group) -> Params:
    """"tp": slice s of F of every local expert goes to rank s, so each rank ends with its
    F slice of all E experts (global expert order: source rank major). fc1's SwiGLU columns
    [gate | up] are sliced block-wise so each rank keeps [gate slice | up slice]."""
    size = dist.get_world_size(group)
    local = experts.num_local_experts
    blocks = 2 if experts.gated else 1
    fc1, fc2 = params["fc1_weight"], params["fc2_weight"]  # [El, H, blocks F], [El, F, H]
    send1 = torch.cat([torch.cat([b.chunk(size, dim=-1)[s] for b in fc1.chunk(blocks, dim=-1)],
                                 dim=-1) for s in range(size)])  # [W El, H, blocks F / W]
    send2 = torch.cat(fc2.chunk(size, dim=1))  # [W El, F / W, H]
    splits = [local] * size
    return {"fc1_weight": all_to_all_uneven(send1, splits, splits, group),
            "fc2_weight": all_to_all_uneven(send2, splits, splits, group)}


def _with_params(experts: torch.nn.Module, params: Optional[Params]) -> Experts:
    """`experts` itself, or a call of it on `params` instead of its own parameters."""
    if params is None:
        return experts
    return lambda *args: torch.func.functional_call(experts, params, args)


class AdaptiveDispatcher(TokenDispatcher):
    """Runs each call of one MoE layer's routed experts in the mode asked for or, with
    `calibrate` / `costs`, in the mode measured (predicted) fastest for its token count."""

    def __init__(self, inner: ExpertParallelDispatcher, local: LocalDispatcher, topk: int,
                 ffn_hidden_size: int, costs: Optional[CollectiveCosts] = None,
                 calibrate: bool = False) -> None:
        self.inner = inner
        self.group, self.size = inner.group, inner.ep_size
        self.local = local  # "dp" / "tp": all E experts (whole or F-sliced) on this rank
        self.topk = topk
        self.tp_possible = ffn_hidden_size % self.size == 0
        self.costs, self.calibrate = costs, calibrate
        self.timings: dict[int, dict[str, float]] = {}  # tokens -> measured seconds per mode
        self.mode_counts: Counter = Counter()
        self.last_mode: Optional[str] = None
        self._choice: dict[int, str] = {}  # tokens per rank -> chosen mode (deterministic)

    def mode_for(self, parallel_mode: Optional[str], adaptive_r: Optional[int]
                 ) -> Optional[str]:
        if adaptive_r is not None:
            return mode_from_adaptive_r(adaptive_r, self.size)
        return parallel_mode

    def modes(self) -> tuple[str, ...]:
        return PARALLEL_MODES if self.tp_possible else ("ep", "dp")

    def cost_inputs(self, experts: torch.nn.Module, num_tokens: int, hidden: int,
                    num_experts: int) -> ModeCostInputs:
        return ModeCostInputs(
            tokens=num_tokens, hidden=hidden, topk=self.topk, num_experts=num_experts,
            ep_size=self.size, local_expert_numel=sum(p.numel() for p in experts.parameters()),
            bytes_per_element=experts.fc1_weight.element_size(),
            dispatcher="alltoall" if isinstance(self.inner, AllToAllDispatcher) else "allgather")

    def choose(self, experts: torch.nn.Module, num_tokens: int, hidden: int,
               num_experts: int) -> str:
        """The fastest mode for `num_tokens` tokens per rank, decided once per token count
        and identical on every rank (agreed timings, same token count everywhere).

        With `calibrate`, each mode's forward + backward is timed on this layer's own
        weights with random tokens of that count (the slowest rank's time): the weights
        enter as detached leaves sharing their storage, so the probes' backward never
        reaches a parameter (no .grad, no gradient hook, no fp32 main grad, nothing the
        optimizer reads); nothing else is touched either. The alpha-beta model of
        cost_model.py misses what a step really pays per collective call and per expert
        group on a given machine. Without calibration the alpha-beta prediction decides."""
        if num_tokens not in self._choice:
            if self.calibrate:
                self._choice[num_tokens] = self._timed_choice(experts, num_tokens, hidden,
                                                              num_experts)
            elif self.costs is not None:
                seconds = predict_mode_seconds(
                    self.costs, self.cost_inputs(experts, num_tokens, hidden, num_experts))
                self._choice[num_tokens] = min(self.modes(), key=seconds.get)
            else:
                return "ep"
        return self._choice[num_tokens]

    def _timed_choice(self, experts: torch.nn.Module, num_tokens: int, hidden: int,
                      num_experts: int, repeats: int = 2) -> str:
        dtype, device = experts.fc1_weight.dtype, experts.fc1_weight.device
        # Probe tokens drawn on the host (its own generator: the training RNG stream is
        # untouched), then moved to the experts' device.
        g = torch.Generator(device="cpu").manual_seed(1234 + dist.get_rank(self.group))
        x = torch.randn(num_tokens, hidden, generator=g, device="cpu").to(device, dtype)  # host
        logits = torch.randn(num_tokens, num_experts, generator=g,
                             device="cpu").to(device)  # drawn on the host
        top = logits.topk(self.topk, dim=1).indices
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top, True)
        probs = torch.softmax(logits, dim=1) * routing_map
        # Leaves of their own on the parameters' storage: the probes' gradients stop here.
        probes = {name: p.detach().requires_grad_() for name, p in experts.named_parameters()}
        modes = self.modes()
        seconds = {m: float("inf") for m in modes}
        # Identity saved-tensor hooks: inside a checkpointed MoE layer the probes' graphs
        # keep their own tensors (the checkpoint's hooks must not see them).
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            for i in range(1 + repeats):  # the first round warms up
                for mode in modes:
                    dist.barrier(group=self.group)
                    start = time.perf_counter()
                    out = self._run(x.requires_grad_(), probs, routing_map, experts, mode,
                                    probes)
                    out.sum().backward()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if i:
                        seconds[mode] = min(seconds[mode], time.perf_counter() - start)
        # On the experts' device: an NCCL group reduces no CPU tensor.
        agreed = torch.tensor([seconds[m] for m in modes], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        agreed_s = agreed.tolist()
        self.timings[num_tokens] = dict(zip(modes, agreed_s))
        return modes[agreed_s.index(min(agreed_s))]

    def forward(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                routing_map_TE: torch.Tensor, experts: torch.nn.Module,
                pad: Optional[int] = None, mode: Optional[str] = None) -> torch.Tensor:
        mode = mode or self.choose(experts, x_TH.shape[0], x_TH.shape[1], probs_TE.shape[1])
        if mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be one of {PARALLEL_MODES}, got {mode!r}")
        if mode == "tp" and not self.tp_possible:
            raise ValueError(f"parallel_mode 'tp' needs the expert hidden size "
                             f"({experts.fc2_weight.shape[1]}) divisible by the "
                             f"expert-parallel size ({self.size})")
        self.last_mode = mode
        if experts.training and not is_recomputing():
            self.mode_counts[mode] += 1
        return self._run(x_TH, probs_TE, routing_map_TE, experts, mode)

    def _run(self, x_TH: torch.Tensor, probs_TE: torch.Tensor, routing_map_TE: torch.Tensor,
             experts: torch.nn.Module, mode: str, params: Optional[Params] = None
             ) -> torch.Tensor:
        """One call in `mode`; `params` replaces the experts' parameters (calibration)."""
        own = dict(experts.named_parameters()) if params is None else params
        if mode == "ep":
            return self.inner(x_TH, probs_TE, routing_map_TE, _with_params(experts, params))
        if mode == "dp":
            gathered = _with_params(experts, gathered_expert_params(own, self.group))
            return self.local(x_TH, probs_TE, routing_map_TE, gathered)
        # "tp": every rank sees every token of the group, computes its F slice of all
        # experts; partial outputs (and, in backward, partial input gradients) are summed.
        x_GH = gather_from_sequence(x_TH, self.group, reduce_grad=True)
        probs_GE = gather_from_sequence(probs_TE, self.group, reduce_grad=True)
        map_GE = all_gather_no_grad(routing_map_TE, self.group)
        sliced = _with_params(experts, hidden_sliced_expert_params(experts, own, self.group))
        return reduce_scatter_to_sequence(self.local(x_GH, probs_GE, map_GE, sliced),
                                          self.group)
