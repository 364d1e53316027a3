"""Expert-parallel token dispatchers (Megatron-Core's alltoall and allgather) and the
expert sharding that goes with them.

With expert parallelism of size EP, rank r of the ep group owns the E_local = E / EP
experts [r * E_local, (r + 1) * E_local). The router still scores all E experts on every
rank; the dispatcher moves each token copy to the rank that owns its expert and the
combine brings the expert outputs back, weighted by the router probabilities:

  alltoall   permute by expert locally -> exchange split sizes (all-to-all of counts)
             -> uneven all-to-all of the rows -> sort the received chunks by local expert
             -> experts -> exact reverse (unsort, reverse all-to-all, unpermute).
  allgather  all-gather tokens, probs and routing map over ep -> each rank permutes the
             gathered tokens for its own experts -> experts -> unpermute -> reduce-scatter.

Each dispatcher splits the work into phases that only compute (`*_preprocess`,
`*_postprocess`) and phases that only communicate (`token_dispatch`, `token_combine`), so
a schedule can overlap them. Every collective is autograd-aware, so gradients reach the
router probabilities, the tokens and the experts exactly; ranks or experts that receive no
token work (zero-size splits and groups).

`apply_expert_parallel` turns a single-process-initialised model into this rank's shard:
the full model is built with the seed first, then each MoE layer keeps its experts' slice,
so local expert j on ep rank r *is* global expert r * E_local + j for any layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megamoe.moe.permute import permute, permute_probs, unpermute
from megamoe.parallel.comm import (
    AsyncHandle,
    all_gather_no_grad,
    all_to_all_counts,
    all_to_all_start,
    all_to_all_uneven,
    all_to_all_wait,
    gather_from_sequence,
    reduce_scatter_to_sequence,
)

DISPATCHER_TYPES = ("allgather", "alltoall")


@dataclass
class _AllToAllState:
    """What the combine needs to reverse one dispatch."""

    token_indices_N: torch.Tensor  # source token of each local copy (expert-major)
    probs_N: torch.Tensor  # combine weight of each local copy
    num_tokens: int
    input_splits: list[int]  # rows sent to each ep rank
    output_splits: list[int]  # rows received from each ep rank
    recv_counts_SE: list[list[int]]  # [source rank][local expert] rows received


@dataclass
class _AllGatherState:
    token_indices_N: torch.Tensor  # index into the gathered [EP * T] tokens
    probs_N: torch.Tensor
    num_gathered: int


class TokenDispatcher(ABC):
    """Common part: which experts this rank owns within the ep group."""

    def __init__(self, num_experts: int, ep_group: Optional[dist.ProcessGroup]) -> None:
        self.group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the "
                             f"expert-parallel size ({self.ep_size})")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.local_start = self.ep_rank * self.num_local_experts

    def forward(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                routing_map_TE: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """[T, H] tokens -> [T, H] weighted sum of their experts' outputs."""
        x_NH, tokens_per_local_expert, state = self.dispatch(x_TH, probs_TE, routing_map_TE)
        return self.combine(experts(x_NH, tokens_per_local_expert), state)

    @abstractmethod
    def dispatch(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                 routing_map_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """-> (rows for the local experts, grouped by local expert; rows per local expert;
        state for combine)."""

    @abstractmethod
    def combine(self, y_NH: torch.Tensor, state: Any) -> torch.Tensor:
        """Local experts' outputs (dispatch order) -> [T, H] for this rank's tokens."""


class AllToAllTokenDispatcher(TokenDispatcher):
    """Megatron's MoEAlltoAllTokenDispatcher (dropless, uneven splits).

    `overlap_degree` N > 1 (Tutel's a2a_ffn_overlap_degree): the tokens are split into N
    chunks; chunk c + 1's all-to-all runs (asynchronously) while the experts compute chunk
    c, and chunk c's combine all-to-all runs while chunk c + 1 computes; the gradient
    exchanges overlap the same way in backward. Every row meets the same expert weights,
    so the result equals N = 1 up to the summation order of the weight gradients.
    """

    def __init__(self, num_experts: int, ep_group: Optional[dist.ProcessGroup],
                 overlap_degree: int = 1) -> None:
        super().__init__(num_experts, ep_group)
        if overlap_degree < 1:
            raise ValueError(f"overlap_degree must be >= 1, got {overlap_degree}")
        self.overlap_degree = overlap_degree

    def forward(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                routing_map_TE: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        if self.overlap_degree == 1 or self.group is None:
            return super().forward(x_TH, probs_TE, routing_map_TE, experts)
        return self._forward_overlapped(x_TH, probs_TE, routing_map_TE, experts)

    def _forward_overlapped(self, x_TH, probs_TE, routing_map_TE, experts) -> torch.Tensor:
        n = self.overlap_degree
        bounds = [len(c) for c in torch.arange(x_TH.shape[0]).tensor_split(n)]
        pre = [self.dispatch_preprocess(x, p, m) for x, p, m in zip(
            x_TH.split(bounds), probs_TE.split(bounds), routing_map_TE.split(bounds))]
        # Split sizes of every chunk in one exchange: [dest rank, chunk, local expert].
        counts_RCL = torch.stack([per_expert_E.view(self.ep_size, self.num_local_experts)
                                  for *_, per_expert_E in pre], dim=1)
        recv_SCL = all_to_all_counts(counts_RCL, self.group)
        states = []
        for c, (_, token_indices_N, probs_N, _) in enumerate(pre):
            input_splits = counts_RCL[:, c].sum(dim=1).tolist()
            output_splits = recv_SCL[:, c].sum(dim=1).tolist()
            states.append(_AllToAllState(token_indices_N, probs_N, bounds[c], input_splits,
                                         output_splits, recv_SCL[:, c].tolist()))
        handles = [AsyncHandle() for _ in range(n)]

        def start(c: int) -> torch.Tensor:
            st = states[c]
            return all_to_all_start(pre[c][0], st.output_splits, st.input_splits, self.group,
                                    handles[c])

        pending = start(0)
        back = []
        for c in range(n):  # communication of chunk c + 1 overlaps compute of chunk c
            upcoming = start(c + 1) if c + 1 < n else None
            st = states[c]
            x_recv = all_to_all_wait(pending, st.output_splits, st.input_splits, self.group,
                                     handles[c])
            x_local, tokens_per_local_expert = self.dispatch_postprocess(
                x_recv, st.recv_counts_SE)
            y_src = self.combine_preprocess(experts(x_local, tokens_per_local_expert), st)
            h = AsyncHandle()
            back.append((h, all_to_all_start(y_src, st.input_splits, st.output_splits,
                                             self.group, h)))
            pending = upcoming
        outs = []
        for (h, y_pending), st in zip(back, states):
            y_NH = all_to_all_wait(y_pending, st.input_splits, st.output_splits, self.group, h)
            outs.append(self.combine_postprocess(y_NH, st))
        return torch.cat(outs)

    def dispatch_preprocess(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                            routing_map_TE: torch.Tensor):
        """Compute: group token copies by global expert (so by owning rank)."""
        x_NH, token_indices_N, tokens_per_expert_E = permute(x_TH, routing_map_TE)
        probs_N = permute_probs(probs_TE, routing_map_TE)
        return x_NH, token_indices_N, probs_N, tokens_per_expert_E

    def token_dispatch(self, x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor
                       ) -> tuple[torch.Tensor, list[int], list[int], list[list[int]]]:
        """Communicate: split sizes first, then the rows (uneven all-to-all)."""
        counts_RL = tokens_per_expert_E.view(self.ep_size, self.num_local_experts)
        recv_SL = all_to_all_counts(counts_RL, self.group)  # [source rank, local expert]
        input_splits = counts_RL.sum(dim=1).tolist()
        output_splits = recv_SL.sum(dim=1).tolist()
        x_recv = all_to_all_uneven(x_NH, output_splits, input_splits, self.group)
        return x_recv, input_splits, output_splits, recv_SL.tolist()

    def dispatch_postprocess(self, x_recv: torch.Tensor, recv_SL: list[list[int]]
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute: source-major chunks -> expert-major (rows of local expert j contiguous)."""
        x_NH = _sort_chunks(x_recv, recv_SL)
        tokens_per_local_expert = torch.tensor(
            [sum(row[j] for row in recv_SL) for j in range(self.num_local_experts)],
            dtype=torch.long)
        return x_NH, tokens_per_local_expert

    def dispatch(self, x_TH, probs_TE, routing_map_TE):
        x_NH, token_indices_N, probs_N, per_expert_E = self.dispatch_preprocess(
            x_TH, probs_TE, routing_map_TE)
        x_recv, input_splits, output_splits, recv_SL = self.token_dispatch(x_NH, per_expert_E)
        x_local, tokens_per_local_expert = self.dispatch_postprocess(x_recv, recv_SL)
        state = _AllToAllState(token_indices_N, probs_N, x_TH.shape[0], input_splits,
                               output_splits, recv_SL)
        return x_local, tokens_per_local_expert, state

    def combine_preprocess(self, y_NH: torch.Tensor, state: _AllToAllState) -> torch.Tensor:
        """Compute: expert-major -> source-major (the inverse of dispatch_postprocess)."""
        return _unsort_chunks(y_NH, state.recv_counts_SE)

    def token_combine(self, y_recv: torch.Tensor, state: _AllToAllState) -> torch.Tensor:
        """Communicate: send every row back to the rank its token came from."""
        return all_to_all_uneven(y_recv, state.input_splits, state.output_splits, self.group)

    def combine_postprocess(self, y_NH: torch.Tensor, state: _AllToAllState) -> torch.Tensor:
        """Compute: weighted sum of each token's k expert outputs."""
        return unpermute(y_NH, state.token_indices_N, state.probs_N, state.num_tokens)

    def combine(self, y_NH, state):
        y_back = self.token_combine(self.combine_preprocess(y_NH, state), state)
        return self.combine_postprocess(y_back, state)


class AllGatherTokenDispatcher(TokenDispatcher):
    """Megatron's MoEAllGatherTokenDispatcher: every rank sees every token of the ep group
    and computes its own experts; the partial outputs are summed by a reduce-scatter."""

    def token_dispatch(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                       routing_map_TE: torch.Tensor):
        """Communicate. The gathers' backward reduce-scatters, since each rank's experts
        contribute a partial gradient for every gathered token and probability."""
        x_GH = gather_from_sequence(x_TH, self.group, reduce_grad=True)  # [EP * T, H]
        probs_GE = gather_from_sequence(probs_TE, self.group, reduce_grad=True)
        map_GE = all_gather_no_grad(routing_map_TE, self.group)
        return x_GH, probs_GE, map_GE

    def dispatch_postprocess(self, x_GH, probs_GE, map_GE):
        """Compute: keep this rank's experts' columns and group their copies by expert."""
        cols = slice(self.local_start, self.local_start + self.num_local_experts)
        local_map = map_GE[:, cols]
        x_NH, token_indices_N, tokens_per_local_expert = permute(x_GH, local_map)
        probs_N = permute_probs(probs_GE[:, cols], local_map)
        return x_NH, tokens_per_local_expert, _AllGatherState(token_indices_N, probs_N,
                                                              x_GH.shape[0])

    def dispatch(self, x_TH, probs_TE, routing_map_TE):
        return self.dispatch_postprocess(*self.token_dispatch(x_TH, probs_TE, routing_map_TE))

    def combine_preprocess(self, y_NH: torch.Tensor, state: _AllGatherState) -> torch.Tensor:
        """Compute: this rank's partial output for every gathered token."""
        return unpermute(y_NH, state.token_indices_N, state.probs_N, state.num_gathered)

    def token_combine(self, partial_GH: torch.Tensor) -> torch.Tensor:
        """Communicate: sum the partial outputs, keep this rank's tokens."""
        return reduce_scatter_to_sequence(partial_GH, self.group)

    def combine(self, y_NH, state):
        return self.token_combine(self.combine_preprocess(y_NH, state))


def _sort_chunks(x_NH: torch.Tensor, counts_SL: list[list[int]]) -> torch.Tensor:
    """Rows in [source][local expert] chunk order -> [local expert][source] order."""
    num_sources, num_local = len(counts_SL), len(counts_SL[0])
    if num_sources == 1 or num_local == 1:
        return x_NH
    chunks = torch.split(x_NH, [c for row in counts_SL for c in row])
    return torch.cat([chunks[s * num_local + j] for j in range(num_local)
                      for s in range(num_sources)])


def _unsort_chunks(y_NH: torch.Tensor, counts_SL: list[list[int]]) -> torch.Tensor:
    """The inverse of _sort_chunks."""
    num_sources, num_local = len(counts_SL), len(counts_SL[0])
    if num_sources == 1 or num_local == 1:
        return y_NH
    chunks = torch.split(y_NH, [counts_SL[s][j] for j in range(num_local)
                                for s in range(num_sources)])
    return torch.cat([chunks[j * num_sources + s] for s in range(num_sources)
                      for j in range(num_local)])


def build_dispatcher(dispatcher_type: str, num_experts: int,
                     ep_group: Optional[dist.ProcessGroup], overlap_degree: int = 1
                     ) -> TokenDispatcher:
    if dispatcher_type == "alltoall":
        return AllToAllTokenDispatcher(num_experts, ep_group, overlap_degree)
    if overlap_degree != 1:
        raise ValueError("the all-to-all overlap degree needs the alltoall dispatcher")
    if dispatcher_type == "allgather":
        return AllGatherTokenDispatcher(num_experts, ep_group)
    raise ValueError(f"--moe-token-dispatcher-type must be one of {DISPATCHER_TYPES}, "
                     f"got {dispatcher_type!r}")


def mark_expert_parallel(module: nn.Module) -> None:
    """Tag routed-expert parameters: reduced over the expert-data-parallel group only and
    counted once per ep rank by the grad norm (`allreduce = False`, as Megatron-Core)."""
    for p in module.parameters():
        p.expert_parallel = True
        p.allreduce = False


@torch.no_grad()
def _shard_experts(experts: nn.Module, start: int, count: int) -> None:
    """Keep experts [start, start + count) of a full (single-process) expert module."""
    from megamoe.moe.experts import GroupedExperts, SequentialExperts

    if isinstance(experts, GroupedExperts):
        for name in ("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"):
            full = getattr(experts, name)
            if full is not None:
                setattr(experts, name, nn.Parameter(full[start:start + count].clone()))
    elif isinstance(experts, SequentialExperts):
        experts.local_experts = nn.ModuleList(list(experts.local_experts)[start:start + count])
    else:
        raise TypeError(f"cannot shard experts of type {type(experts).__name__}")
    experts.num_local_experts = count
    experts.expert_offset = start


def apply_expert_parallel(model: nn.Module, ep_group: Optional[dist.ProcessGroup],
                          dispatcher_type: str = "allgather", *,
                          tp_group: Optional[dist.ProcessGroup] = None,
                          etp_group: Optional[dist.ProcessGroup] = None,
                          overlap_degree: int = 1) -> nn.Module:
    """Mark every MoE layer's routed experts; with an ep group, keep this rank's slice of
    them and give the layer a token dispatcher; with a tp group (sequence parallelism),
    split the experts' hidden dimension over `etp_group` (ETP = TP) or the tokens over the
    TP ranks (ETP = 1), see expert_tensor_parallel.py. In place; returns `model`.

    With one ep rank both dispatchers would only permute locally, which is exactly the
    layer's own dispatch path, so no dispatcher is attached."""
    from megamoe.moe.expert_tensor_parallel import build_moe_tensor_parallel, shard_expert_hidden
    from megamoe.moe.layer import MoELayer

    moe_tp = build_moe_tensor_parallel(tp_group, etp_group)
    for layer in [m for m in model.modules() if isinstance(m, MoELayer)]:
        if ep_group is not None and dist.get_world_size(ep_group) > 1:
            if layer.config.router_type != "topk":
                raise ValueError("expert parallelism needs the token-choice (topk) router")
            if layer.config.pad_to_capacity or layer.config.capacity_factor == 0:
                raise ValueError("expert parallelism does not pad expert inputs to capacity "
                                 "(--moe-pad-expert-input-to-capacity)")
            dispatcher = build_dispatcher(dispatcher_type, layer.config.num_experts, ep_group,
                                          overlap_degree)
            _shard_experts(layer.experts, dispatcher.local_start, dispatcher.num_local_experts)
            layer.token_dispatcher = dispatcher
        if moe_tp is not None:  # after the ep slice, which makes new parameters
            shard_expert_hidden(layer.experts, moe_tp.etp_group)
            layer.tensor_parallel = moe_tp
        mark_expert_parallel(layer.experts)
    return model
