"""The MoE layer inside a tensor-parallel (+ sequence-parallel) model: expert tensor
parallelism (ETP, Megatron's --expert-tensor-parallel-size) and token partitioning.

Under TP the decoder keeps [S/TP, B, H] sequence shards; the MoE layer receives the
all-gathered [S, B, H] (every TP rank routes the same tokens, so routing and the aux
losses equal the single-process ones and the router needs no TP reduction) and returns
this rank's [S/TP, B, H] shard. Between those, the routed experts run in one of two ways:

  ETP = TP  every expert's hidden dimension F is split over the etp group (= the tp
            group): fc1 keeps columns [gate slice r | up slice r], fc2 rows slice r. All
            ranks feed the same tokens; the partial outputs are reduce-scattered to
            sequence shards (a row-parallel exit). The token and probability gradients
            are partial per rank and are summed over etp on the way back (a column-
            parallel entry), so the replicated router still sees the full gradient.
  ETP = 1   experts are whole; the tokens are partitioned over the TP ranks (rank r takes
            rows [r T/TP, (r+1) T/TP), which is exactly its own sequence shard), so each
            expert GEMM runs once per token, not TP times. The partition's backward
            all-gathers the gradients, again keeping the router's gradient full.

The expert-parallel dispatcher (dispatcher.py) runs unchanged in between, over the ep group
of the expert mesh. Expert gradients are then summed over edp (which, with ETP = 1, holds
the TP ranks: they saw different tokens) and divided by DP, as data_parallel documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megamoe.parallel.comm import (
    copy_to_tp,
    gather_from_sequence,
    group_rank,
    group_size,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)

Group = Optional[dist.ProcessGroup]


@dataclass
class MoETensorParallel:
    """How one MoE layer spans the TP group: `etp_group` set = experts split over F (the
    etp group is then the tp group), else tokens partitioned over `tp_group`."""

    tp_group: Group
    etp_group: Group = None

    @property
    def tp_size(self) -> int:
        return group_size(self.tp_group)

    @property
    def partition_group(self) -> Group:
        return None if self.etp_group is not None else self.tp_group

    def enter(self, x_TH: torch.Tensor, probs_TE: torch.Tensor, routing_map_TE: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replicated routed tokens -> what this rank's experts take."""
        if self.etp_group is not None:  # every etp rank sees all tokens, gradients summed
            return (copy_to_tp(x_TH, self.etp_group), copy_to_tp(probs_TE, self.etp_group),
                    routing_map_TE)
        group = self.partition_group  # this rank's rows; the backward all-gathers
        return (scatter_to_sequence(x_TH, group), scatter_to_sequence(probs_TE, group),
                routing_map_TE.chunk(self.tp_size)[group_rank(group)])

    def exit(self, routed_TH: torch.Tensor) -> torch.Tensor:
        """This rank's expert output -> its sequence shard of the summed output."""
        if self.etp_group is not None:
            return reduce_scatter_to_sequence(routed_TH, self.etp_group)
        return routed_TH  # already the own partition = own sequence shard

    def shard(self, full_TH: torch.Tensor) -> torch.Tensor:
        """A replicated full output (shared experts) -> this rank's sequence shard."""
        return scatter_to_sequence(full_TH, self.tp_group)

    def gather_input(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """Sequence shard -> the full sequence every TP rank routes (replicated consumer)."""
        return gather_from_sequence(x_SBH, self.tp_group, reduce_grad=False)


def build_moe_tensor_parallel(tp_group: Group, etp_group: Group) -> Optional[MoETensorParallel]:
    """None without TP; ETP must be 1 or the TP size (the etp group is then the tp group)."""
    tp, etp = group_size(tp_group), group_size(etp_group)
    if tp == 1 and etp == 1:
        return None
    if etp not in (1, tp):
        raise ValueError(f"not supported yet: --expert-tensor-parallel-size {etp} other "
                         f"than 1 or --tensor-model-parallel-size ({tp})")
    return MoETensorParallel(tp_group, etp_group if etp > 1 else None)


@torch.no_grad()
def shard_expert_hidden(experts: nn.Module, etp_group: Group) -> None:
    """Keep this etp rank's slice of every local expert's hidden dimension F (in place).

    fc1 [E, H, 2F] -> [E, H, 2F/ETP] = [gate cols slice r | up cols slice r] (SwiGLU) or
    [E, H, F/ETP]; fc2 [E, F, H] -> [E, F/ETP, H]; fc1 bias like fc1's columns. The fc2 bias
    is replicated and each rank adds 1/ETP of it (the partial outputs are summed); its
    gradient is then partial, summed over TP like a sequence-parallel parameter."""
    from megamoe.moe.experts import GroupedExperts

    size, rank = group_size(etp_group), group_rank(etp_group)
    experts.etp_size, experts.etp_rank = size, rank
    if size == 1:
        return
    if not isinstance(experts, GroupedExperts):
        raise ValueError("expert tensor parallelism (--expert-tensor-parallel-size > 1) "
                         "needs the built-in grouped experts, not custom expert modules")
    blocks = 2 if experts.swiglu else 1
    ffn = experts.fc2_weight.shape[1]
    if ffn % size:
        raise ValueError(f"--moe-ffn-hidden-size ({ffn}) must be divisible by "
                         f"--expert-tensor-parallel-size ({size})")

    def columns(full: torch.Tensor) -> torch.Tensor:  # [..., blocks * F] -> own slices
        return torch.cat([b.chunk(size, dim=-1)[rank] for b in full.chunk(blocks, dim=-1)],
                         dim=-1).contiguous()

    experts.fc1_weight = nn.Parameter(columns(experts.fc1_weight))
    experts.fc2_weight = nn.Parameter(experts.fc2_weight.chunk(size, dim=1)[rank].contiguous())
    if experts.fc1_bias is not None:
        experts.fc1_bias = nn.Parameter(columns(experts.fc1_bias))
    for p in (experts.fc1_weight, experts.fc2_weight, experts.fc1_bias):
        if p is not None:
            p.etp_sharded = True
    if experts.fc2_bias is not None:
        experts.fc2_bias.sequence_parallel = True  # partial gradient: summed over tp = etp
    experts.fc2_bias_scale = 1.0 / size
