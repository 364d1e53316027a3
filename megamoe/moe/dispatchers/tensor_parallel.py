"""The MoE layer inside a tensor-parallel (+ sequence-parallel) model: expert tensor
parallelism (ETP, Megatron's --expert-tensor-parallel-size) or token partitioning around
the layer's (local or expert-parallel) dispatcher.

Under TP the decoder keeps [S/TP, B, H] sequence shards. The layer gathers the whole
sequence (`gather_sequence`: every TP rank routes the same tokens, so routing and the aux
losses equal the single-process ones and the router needs no TP reduction; capacity drops
are counted per shard, below) and returns
this rank's [S/TP, B, H] shard. Between those, the routed experts run in one of two ways:

  ETP = TP  every expert's hidden dimension F is split over the etp group (= the tp
            group): fc1 keeps columns [gate slice r | up slice r], fc2 rows slice r
            (moe/sharding.py). All ranks feed the same tokens; the partial outputs are
            reduce-scattered to sequence shards (a row-parallel exit). The token and
            probability gradients are partial per rank and are summed over etp on the way
            back (a column-parallel entry), so the replicated router sees the full gradient.
  ETP = 1   experts are whole; the tokens are partitioned over the TP ranks (rank r takes
            rows [r T/TP, (r+1) T/TP), which is exactly its own sequence shard), so each
            expert GEMM runs once per token, not TP times. The partition's backward
            all-gathers the gradients, again keeping the router's gradient full.

Capacity (--moe-expert-capacity-factor) is counted over each TP rank's sequence shard of
the gathered tokens, as Megatron's router does on each rank's shard (`capacity_shards`);
`capacity_per_shard=False` (--moe-capacity-over-tp-gathered-sequence) counts it over the
gathered sequence. Padding is then per shard: with ETP = TP the experts see all TP
shards, so each expert's group is padded to TP x the per-shard capacity.

The inner dispatcher runs unchanged in between, over the ep group of the expert mesh.
Expert gradients are then summed over edp (which, with ETP = 1, holds the TP ranks: they
saw different tokens) and divided by DP, as training/optim/grads.py documents.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megamoe.moe.dispatchers.base import Experts, SharedHalves, TokenDispatcher
from megamoe.parallel.comm import (
    copy_to_tp,
    gather_from_sequence,
    group_rank,
    group_size,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)

Group = Optional[dist.ProcessGroup]


class TensorParallelDispatcher(TokenDispatcher):
    """`inner` inside the TP group: experts split over F when `etp_group` is set (it is then
    the tp group), else the routed tokens partitioned over `tp_group`. Capacity is counted
    per TP shard unless `capacity_per_shard` is False."""

    def __init__(self, inner: TokenDispatcher, tp_group: Group, etp_group: Group = None,
                 capacity_per_shard: bool = True):
        self.inner = inner
        self.tp_group, self.etp_group = tp_group, etp_group
        self.capacity_per_shard = capacity_per_shard

    def capacity_shards(self) -> int:
        return group_size(self.tp_group) if self.capacity_per_shard else 1

    def gather_sequence(self, hidden_SBH: torch.Tensor) -> torch.Tensor:
        """Sequence shard -> the full sequence every TP rank routes (replicated consumer:
        the backward keeps this rank's chunk of the gradient)."""
        return gather_from_sequence(hidden_SBH, self.tp_group, reduce_grad=False)

    def mode_for(self, parallel_mode, adaptive_r):
        return self.inner.mode_for(parallel_mode, adaptive_r)

    def forward(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                routing_map_TE: torch.Tensor, experts: Experts, pad: Optional[int] = None,
                mode: Optional[str] = None, shared: Optional[SharedHalves] = None
                ) -> torch.Tensor:
        """`shared`'s halves run inside the inner dispatcher's exchanges."""
        if self.etp_group is not None:  # every etp rank sees all tokens, gradients summed
            x_in, probs_in = copy_to_tp(x_TH, self.etp_group), copy_to_tp(probs_TE,
                                                                         self.etp_group)
            pad_all = None if pad is None else pad * self.capacity_shards()
            out_TH = self.inner(x_in, probs_in, routing_map_TE, experts, pad_all, mode,
                                shared=shared)
            return reduce_scatter_to_sequence(out_TH, self.etp_group)
        group = self.tp_group  # this rank's rows = its own sequence shard
        x_in, probs_in = scatter_to_sequence(x_TH, group), scatter_to_sequence(probs_TE, group)
        map_in = routing_map_TE.chunk(group_size(group))[group_rank(group)]
        return self.inner(x_in, probs_in, map_in, experts, pad, mode, shared=shared)
