"""Megatron-Core's alltoall token dispatcher (dropless, uneven splits), optionally
overlapping the exchange with the expert GEMMs.

  permute by expert locally -> exchange split sizes (all-to-all of counts) -> uneven
  all-to-all of the rows -> sort the received chunks by local expert -> experts -> the
  exact reverse (unsort, reverse all-to-all, unpermute).

The work is split into phases that only compute (`*_preprocess`, `*_postprocess`) and
phases that only communicate (`token_dispatch`, `token_combine`), so the overlapped
forward can interleave them.

Host synchronisations per dispatch: two, whatever the overlap degree. The permutation's
(the number of rows to group, permute.py; one for all overlap chunks), and one
device->host copy of every split size the dispatch needs (what this rank sends and what
it receives, per rank and local expert, for every overlap chunk at once): the uneven
all-to-all takes its split sizes as host lists. The rows per local expert reach the
experts on the device (a sum of the received counts) and on the host (from that copy,
for experts that need them there). The backward adds none: it reuses the host split
sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megamoe.moe.dispatchers.base import Experts, SharedHalves
from megamoe.moe.dispatchers.expert_parallel import ExpertParallelDispatcher
from megamoe.moe.grouped_gemm import GroupSizes
from megamoe.moe.permute import (
    expert_major_rows,
    permute_with_probs,
    select_probs,
    unpermute,
)
from megamoe.parallel.comm import (
    AsyncHandle,
    all_to_all_counts,
    all_to_all_start,
    all_to_all_uneven,
    all_to_all_wait,
)


@dataclass
class _Splits:
    """Split sizes of one exchange (one overlap chunk)."""

    input_splits: list[int]  # rows sent to each ep rank (host)
    output_splits: list[int]  # rows received from each ep rank (host)
    recv_counts_SL: list[list[int]]  # [source rank][local expert] rows received (host)
    tokens_per_local_expert: GroupSizes  # [local expert] rows received (device and host)


@dataclass
class _AllToAllState:
    """What the combine needs to reverse one dispatch."""

    token_indices_N: torch.Tensor  # source token of each local copy (expert-major)
    probs_N: torch.Tensor  # combine weight of each local copy
    num_tokens: int
    splits: _Splits


def _chunk_sizes(num_tokens: int, n: int) -> list[int]:
    """Rows of each of n chunks, as torch.tensor_split cuts them (the first ones longer)."""
    return [num_tokens // n + (1 if c < num_tokens % n else 0) for c in range(n)]


class AllToAllDispatcher(ExpertParallelDispatcher):
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
        self.overlap_degree = overlap_degree

    def forward(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                routing_map_TE: torch.Tensor, experts: Experts, pad: Optional[int] = None,
                mode: Optional[str] = None, shared: Optional[SharedHalves] = None
                ) -> torch.Tensor:
        """With `shared` (--moe-shared-expert-overlap) the exchanges are asynchronous, as
        with an overlap degree > 1 (which is then also honoured): the shared expert's fc1
        runs while the (first) dispatch all-to-all is in flight, its fc2 while the (last)
        combine all-to-all is."""
        if self.group is None or (self.overlap_degree == 1 and shared is None):
            return super().forward(x_TH, probs_TE, routing_map_TE, experts, shared=shared)
        return self._forward_overlapped(x_TH, probs_TE, routing_map_TE, experts, shared)

    def exchange_split_sizes(self, tokens_per_expert_CE: list[torch.Tensor]) -> list[_Splits]:
        """Communicate the split sizes of every chunk in one all-to-all of counts, then
        copy what this rank sends and receives to the host in one go (the dispatch's one
        split-size sync)."""
        counts_RCL = torch.stack([per_expert_E.view(self.ep_size, self.num_local_experts)
                                  for per_expert_E in tokens_per_expert_CE], dim=1)
        recv_SCL = all_to_all_counts(counts_RCL, self.group)  # [source rank, chunk, local]
        sent_host, recv_host = torch.stack([counts_RCL, recv_SCL]).tolist()  # one D2H copy
        out = []
        for c in range(len(tokens_per_expert_CE)):
            recv_SL = [per_chunk[c] for per_chunk in recv_host]
            per_local = GroupSizes(recv_SCL[:, c].sum(dim=0),
                                   host=[sum(col) for col in zip(*recv_SL)])
            out.append(_Splits(input_splits=[sum(per_chunk[c]) for per_chunk in sent_host],
                               output_splits=[sum(row) for row in recv_SL],
                               recv_counts_SL=recv_SL, tokens_per_local_expert=per_local))
        return out

    def _forward_overlapped(self, x_TH, probs_TE, routing_map_TE, experts,
                            shared: Optional[SharedHalves] = None) -> torch.Tensor:
        n = self.overlap_degree
        bounds = _chunk_sizes(x_TH.shape[0], n)
        # Every chunk's permutation from one nonzero (rows chunk-major), every chunk's
        # split sizes from one host copy; the rows per chunk are among them.
        rows = expert_major_rows(routing_map_TE, bounds)
        x_NH = x_TH.index_select(0, rows.token_indices_N)
        probs_N = select_probs(probs_TE, rows)
        all_splits = self.exchange_split_sizes(list(rows.tokens_per_expert_E.view(n, -1)))
        rows_C = [sum(sp.input_splits) for sp in all_splits]
        firsts = [sum(bounds[:c]) for c in range(n)]  # first token of each chunk
        x_chunks = x_NH.split(rows_C)
        states = [_AllToAllState(idx_N - first, p_N, size, sp) for idx_N, p_N, size, first, sp
                  in zip(rows.token_indices_N.split(rows_C), probs_N.split(rows_C), bounds,
                         firsts, all_splits)]
        handles = [AsyncHandle() for _ in range(n)]

        def start(c: int) -> torch.Tensor:
            sp = states[c].splits
            return all_to_all_start(x_chunks[c], sp.output_splits, sp.input_splits, self.group,
                                    handles[c])

        pending = start(0)
        if shared is not None:  # while the (first) dispatch exchange is in flight
            shared.fc1()
        back = []
        for c in range(n):  # communication of chunk c + 1 overlaps compute of chunk c
            upcoming = start(c + 1) if c + 1 < n else None
            st, sp = states[c], states[c].splits
            x_recv = all_to_all_wait(pending, sp.output_splits, sp.input_splits, self.group,
                                     handles[c])
            x_local, tokens_per_local_expert = self.dispatch_postprocess(x_recv, sp)
            y_src = self.combine_preprocess(experts(x_local, tokens_per_local_expert), st)
            h = AsyncHandle()
            back.append((h, all_to_all_start(y_src, sp.input_splits, sp.output_splits,
                                             self.group, h)))
            pending = upcoming
        if shared is not None:  # while the (last) combine exchange is in flight
            shared.fc2()
        outs = []
        for (h, y_pending), st in zip(back, states):
            sp = st.splits
            y_NH = all_to_all_wait(y_pending, sp.input_splits, sp.output_splits, self.group, h)
            outs.append(self.combine_postprocess(y_NH, st))
        return torch.cat(outs)

    def dispatch_preprocess(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                            routing_map_TE: torch.Tensor):
        """Compute: group token copies by global expert (so by owning rank)."""
        x_NH, token_indices_N, probs_N, tokens_per_expert_E = permute_with_probs(
            x_TH, probs_TE, routing_map_TE)
        return x_NH, token_indices_N, probs_N, tokens_per_expert_E

    def token_dispatch(self, x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor
                       ) -> tuple[torch.Tensor, _Splits]:
        """Communicate: split sizes first, then the rows (uneven all-to-all)."""
        splits = self.exchange_split_sizes([tokens_per_expert_E])[0]
        x_recv = all_to_all_uneven(x_NH, splits.output_splits, splits.input_splits,
                                   self.group)
        return x_recv, splits

    def dispatch_postprocess(self, x_recv: torch.Tensor, splits: _Splits
                             ) -> tuple[torch.Tensor, GroupSizes]:
        """Compute: source-major chunks -> expert-major (rows of local expert j contiguous);
        the rows per local expert come with the splits, on the device and, for experts
        that need them there (grouped_gemm package, loop, expert modules), on the host."""
        return _sort_chunks(x_recv, splits.recv_counts_SL), splits.tokens_per_local_expert

    def dispatch(self, x_TH, probs_TE, routing_map_TE, pad=None):
        x_NH, token_indices_N, probs_N, per_expert_E = self.dispatch_preprocess(
            x_TH, probs_TE, routing_map_TE)
        x_recv, splits = self.token_dispatch(x_NH, per_expert_E)
        x_local, tokens_per_local_expert = self.dispatch_postprocess(x_recv, splits)
        state = _AllToAllState(token_indices_N, probs_N, x_TH.shape[0], splits)
        return (x_local, tokens_per_local_expert), state

    def combine_preprocess(self, y_NH: torch.Tensor, state: _AllToAllState) -> torch.Tensor:
        """Compute: expert-major -> source-major (the inverse of dispatch_postprocess)."""
        return _unsort_chunks(y_NH, state.splits.recv_counts_SL)

    def token_combine(self, y_recv: torch.Tensor, state: _AllToAllState) -> torch.Tensor:
        """Communicate: send every row back to the rank its token came from."""
        sp = state.splits
        return all_to_all_uneven(y_recv, sp.input_splits, sp.output_splits, self.group)

    def combine_postprocess(self, y_NH: torch.Tensor, state: _AllToAllState) -> torch.Tensor:
        """Compute: weighted sum of each token's k expert outputs."""
        return unpermute(y_NH, state.token_indices_N, state.probs_N, state.num_tokens)

    def combine(self, y_NH, state):
        y_back = self.token_combine(self.combine_preprocess(y_NH, state), state)
        return self.combine_postprocess(y_back, state)


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
