"""Megatron-Core's alltoall token dispatcher (dropless, uneven splits), optionally
overlapping the exchange with the expert GEMMs.

  permute by expert locally -> exchange split sizes (all-to-all of counts) -> uneven
  all-to-all of the rows -> sort the received chunks by local expert -> experts -> the
  exact reverse (unsort, reverse all-to-all, unpermute).

The work is split into phases that only compute (`*_preprocess`, `*_postprocess`) and
phases that only communicate (`token_dispatch`, `token_combine`), so the overlapped
forward can interleave them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megamoe.moe.dispatchers.base import Experts
from megamoe.moe.dispatchers.expert_parallel import ExpertParallelDispatcher
from megamoe.moe.permute import permute, permute_probs, unpermute
from megamoe.parallel.comm import (
    AsyncHandle,
    all_to_all_counts,
    all_to_all_start,
    all_to_all_uneven,
    all_to_all_wait,
)


@dataclass
class _AllToAllState:
    """What the combine needs to reverse one dispatch."""

    token_indices_N: torch.Tensor  # source token of each local copy (expert-major)
    probs_N: torch.Tensor  # combine weight of each local copy
    num_tokens: int
    input_splits: list[int]  # rows sent to each ep rank
    output_splits: list[int]  # rows received from each ep rank
    recv_counts_SE: list[list[int]]  # [source rank][local expert] rows received



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
                mode: Optional[str] = None) -> torch.Tensor:
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

    def dispatch(self, x_TH, probs_TE, routing_map_TE, pad=None):
        x_NH, token_indices_N, probs_N, per_expert_E = self.dispatch_preprocess(
            x_TH, probs_TE, routing_map_TE)
        x_recv, input_splits, output_splits, recv_SL = self.token_dispatch(x_NH, per_expert_E)
        x_local, tokens_per_local_expert = self.dispatch_postprocess(x_recv, recv_SL)
        state = _AllToAllState(token_indices_N, probs_N, x_TH.shape[0], input_splits,
                               output_splits, recv_SL)
        return (x_local, tokens_per_local_expert), state

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
