"""Dispatch to experts on this rank: a sort-based permutation, no communication."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megamoe.moe.dispatchers.base import TokenDispatcher
from megamoe.moe.permute import permute_padded, permute_with_probs, unpermute


@dataclass
class LocalState:
    token_indices_N: torch.Tensor  # source token of each copy (num_tokens for padding)
    probs_N: torch.Tensor  # combine weight of each copy (0 for padding)
    num_tokens: int
    padded: bool


class LocalDispatcher(TokenDispatcher):
    """Every expert of the layer on this rank (expert-parallel size 1, or the all-experts
    modes of adaptive parallelism).

    `fuse_gather`: the experts take the [T, H] tokens plus the row -> token indices and
    gather inside their first GEMM (grouped experts), so the [N, H] copies are never
    stored. `combine_in_experts`: the experts also take the combine weights (they scale
    the activation before the last GEMM, grouped experts with SwiGLU or F <= H), so the
    combine only sums. Capacity padding (`pad`) makes every group `pad` rows long with
    zero rows of weight 0.

    Host synchronisation: one per dispatch without padding (the permutation's nonzero:
    the number of rows is data-dependent), none with padding (static sizes).
    """

    def __init__(self, fuse_gather: bool = False, combine_in_experts: bool = False) -> None:
        self.fuse_gather = fuse_gather
        self.combine_in_experts = combine_in_experts

    @classmethod
    def for_experts(cls, experts: torch.nn.Module) -> LocalDispatcher:
        fuse = bool(getattr(experts, "fuses_gather", False))
        return cls(fuse, fuse and bool(getattr(experts, "combine_in_experts", False)))

    def dispatch(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                 routing_map_TE: torch.Tensor, pad: Optional[int] = None
                 ) -> tuple[tuple, LocalState]:
        num_tokens = x_TH.shape[0]
        fuse = self.fuse_gather
        if pad is None:  # one device->host sync: the number of rows (permute.py)
            x_NH, token_indices_N, probs_N, tokens_per_expert_E = permute_with_probs(
                x_TH, probs_TE, routing_map_TE, gather=not fuse)
        else:  # static size E * pad: no sync
            token_indices_N, probs_N = permute_padded(probs_TE, routing_map_TE, pad,
                                                      pad_index=num_tokens)
            x_ext_TH = torch.cat([x_TH, x_TH.new_zeros(1, x_TH.shape[1])])  # row T = pad
            tokens_per_expert_E = torch.full((routing_map_TE.shape[1],), pad,
                                             dtype=torch.long, device=x_TH.device)
            x_NH = x_ext_TH if fuse else x_ext_TH.index_select(0, token_indices_N)
        state = LocalState(token_indices_N, probs_N, num_tokens, pad is not None)
        if not fuse:
            return (x_NH, tokens_per_expert_E), state
        probs_in = probs_N if self.combine_in_experts else None
        return (x_NH, tokens_per_expert_E, probs_in, token_indices_N), state

    def combine(self, y_NH: torch.Tensor, state: LocalState) -> torch.Tensor:
        probs_N = None if self.combine_in_experts else state.probs_N
        if state.padded:  # padding rows land in an extra row that is dropped
            return unpermute(y_NH, state.token_indices_N, probs_N, state.num_tokens + 1
                             )[: state.num_tokens]
        return unpermute(y_NH, state.token_indices_N, probs_N, state.num_tokens)
