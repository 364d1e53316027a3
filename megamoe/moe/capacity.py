"""Expert capacity: a separate step between routing and dispatch.

Routing decides which experts each token wants; this step decides which of those
assignments fit. Capacity semantics (fair share = T * k / E):

  capacity_factor > 0   C = ceil(cf x fair share)                  (Megatron, Tutel)
  capacity_factor == 0  C = the largest load actually routed: no drops, padded (Tutel)
  capacity_factor < 0   C = min(largest load, ceil(|cf| x fair share))        (Tutel)

Drop policies (Megatron): "probs" keeps each expert's C highest-probability tokens,
"position" keeps its first C tokens in sequence order. Everything is O(T * E) booleans;
nothing here is proportional to T * E * C.

`num_shards` S > 1: the T rows are S equal contiguous blocks (under tensor + sequence
parallelism, the TP ranks' sequence shards of the gathered sequence) and capacity is
counted in each block separately, with T / S tokens each, as Megatron's router does on
each rank's shard. One C serves every block: for cf > 0 the blocks' capacities are equal;
for cf <= 0, C is the largest of the blocks' own capacities, which drops exactly what each
block's own capacity would (a block whose largest load is below C drops nothing either
way) and is the tightest padding every block fits in.
"""

from __future__ import annotations

import math

import torch

from megamoe.parallel.checkpointing import replay_once

DROP_POLICIES = ("probs", "position")


def expert_capacity(routing_map_TE: torch.Tensor, topk: int, capacity_factor: float,
                    num_shards: int = 1) -> int:
    """Rows per expert (per block of T / num_shards rows) for this routing map and
    capacity factor (see module docstring)."""
    num_tokens, num_experts = routing_map_TE.shape
    fair = num_tokens // num_shards * topk / num_experts
    if capacity_factor > 0:
        return max(1, math.ceil(capacity_factor * fair))
    needed = (int(routing_map_TE.view(num_shards, -1, num_experts).sum(dim=1).max())
              if num_tokens else 0)
    if capacity_factor == 0:
        return max(1, needed)
    return max(1, min(needed, math.ceil(-capacity_factor * fair)))


def apply_capacity(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, capacity: int,
                   drop_policy: str = "probs", num_shards: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs_TE, routing_map_TE) with the assignments beyond `capacity` per expert (in
    each block of T / num_shards rows) removed."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"--moe-token-drop-policy must be one of {DROP_POLICIES}, "
                         f"got {drop_policy!r}")
    num_tokens, num_experts = routing_map_TE.shape
    if num_tokens % num_shards:
        raise ValueError(f"capacity: {num_tokens} tokens are not {num_shards} equal shards")
    if capacity >= num_tokens // num_shards:
        return probs_TE, routing_map_TE
    map_STE = routing_map_TE.view(num_shards, -1, num_experts)
    if drop_policy == "probs":
        ranked_STE = probs_TE.detach().view_as(map_STE).masked_fill(~map_STE, float("-inf"))
        idx_SCE = replay_once(lambda: ranked_STE.topk(capacity, dim=1).indices)  # (as routing)
        within_STE = torch.zeros_like(map_STE).scatter(1, idx_SCE, True)
    else:
        position_STE = map_STE.to(torch.int32).cumsum(dim=1)  # 1-based slot per expert
        within_STE = position_STE <= capacity
    keep_TE = (map_STE & within_STE).view_as(routing_map_TE)
    return probs_TE * keep_TE, keep_TE
