"""Megatron-Core's allgather token dispatcher: every rank sees every token of the ep
group and computes its own experts; the partial outputs are summed by a reduce-scatter.

  all-gather tokens, probs and routing map over ep -> each rank permutes the gathered
  tokens for its own experts -> experts -> unpermute -> reduce-scatter.

Host synchronisation: one per dispatch, the permutation's (how many gathered token copies
this rank's experts got is data-dependent); the collectives have static sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.moe.dispatchers.expert_parallel import ExpertParallelDispatcher
from megamoe.moe.permute import permute_with_probs, unpermute
from megamoe.parallel.comm import (
    all_gather_no_grad,
    gather_from_sequence,
    reduce_scatter_to_sequence,
)


@dataclass
class _AllGatherState:
    token_indices_N: torch.Tensor  # index into the gathered [EP * T] tokens
    probs_N: torch.Tensor
    num_gathered: int


class AllGatherDispatcher(ExpertParallelDispatcher):
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
        """Compute: keep this rank's experts' columns and group their copies by expert
        (the one device->host sync of this dispatcher: the number of rows, permute.py)."""
        cols = slice(self.local_start, self.local_start + self.num_local_experts)
        x_NH, token_indices_N, probs_N, tokens_per_local_expert = permute_with_probs(
            x_GH, probs_GE[:, cols], map_GE[:, cols])
        return x_NH, tokens_per_local_expert, _AllGatherState(token_indices_N, probs_N,
                                                              x_GH.shape[0])

    def dispatch(self, x_TH, probs_TE, routing_map_TE, pad=None):
        x_NH, tokens_per_local_expert, state = self.dispatch_postprocess(
            *self.token_dispatch(x_TH, probs_TE, routing_map_TE))
        return (x_NH, tokens_per_local_expert), state

    def combine_preprocess(self, y_NH: torch.Tensor, state: _AllGatherState) -> torch.Tensor:
        """Compute: this rank's partial output for every gathered token."""
        return unpermute(y_NH, state.token_indices_N, state.probs_N, state.num_gathered)

    def token_combine(self, partial_GH: torch.Tensor) -> torch.Tensor:
        """Communicate: sum the partial outputs, keep this rank's tokens."""
        return reduce_scatter_to_sequence(partial_GH, self.group)

    def combine(self, y_NH, state):
        return self.token_combine(self.combine_preprocess(y_NH, state))
