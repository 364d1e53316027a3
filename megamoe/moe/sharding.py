"""Keeping this rank's part of a layer's routed experts (the parallelize step calls these).

Every rank builds (or holds on the meta device) the whole expert stack of the single-
process model with the seed, then keeps its slice, so local expert j on ep rank r *is*
global expert r * E_local + j in any layout, and an etp rank's hidden slice is exactly the
columns / rows of the single-process weights.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.moe.experts import GroupedExperts, SequentialExperts


def mark_expert_parallel(experts: nn.Module) -> None:
    """Tag routed-expert parameters: reduced over the expert-data-parallel group only and
    counted once per ep rank by the grad norm (`allreduce = False`, as Megatron-Core)."""
    for p in experts.parameters():
        p.expert_parallel = True
        p.allreduce = False


@torch.no_grad()
def shard_experts(experts: nn.Module, start: int, count: int) -> None:
    """Keep experts [start, start + count) of a whole expert module (in place)."""
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


@torch.no_grad()
def shard_expert_hidden(experts: nn.Module, size: int, rank: int) -> None:
    """Keep etp rank `rank`'s slice (of `size`) of every local expert's hidden dimension F.

    fc1 [E, H, 2F] -> [E, H, 2F/ETP] = [gate cols slice r | up cols slice r] (SwiGLU) or
    [E, H, F/ETP]; fc2 [E, F, H] -> [E, F/ETP, H]; fc1 bias like fc1's columns. The fc2 bias
    is replicated and each rank adds 1/ETP of it (the partial outputs are summed); its
    gradient is then partial, summed over TP like a sequence-parallel parameter."""
    experts.etp_size, experts.etp_rank = size, rank
    if size == 1:
        return
    if not isinstance(experts, GroupedExperts):
        raise ValueError("expert tensor parallelism (--expert-tensor-parallel-size > 1) "
                         "needs the built-in grouped experts, not custom expert modules")
    blocks = 2 if experts.gated else 1

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
