"""Expert capacity: a separate step between routing and dispatch.

Routing decides which experts each token wants; this step decides which of those
assignments fit. Capacity semantics (fair share = T * k / E):

  capacity_factor > 0   C = ceil(cf x fair share)                  (Megatron, Tutel)
  capacity_factor == 0  C = the largest load actually routed: no drops, padded (Tutel)
  capacity_factor < 0   C = min(largest load, ceil(|cf| x fair share))        (Tutel)

Drop policies (Megatron): "probs" keeps each expert's C highest-probability tokens,
"position" keeps its first C tokens in sequence order. Everything is O(T * E) booleans;
nothing here is proportional to T * E * C.
"""

from __future__ import annotations

import math

import torch

DROP_POLICIES = ("probs", "position")


def expert_capacity(routing_map_TE: torch.Tensor, topk: int, capacity_factor: float) -> int:
    """Rows per expert for this routing map and capacity factor (see module docstring)."""
    num_tokens, num_experts = routing_map_TE.shape
    fair = num_tokens * topk / num_experts
    if capacity_factor > 0:
        return max(1, math.ceil(capacity_factor * fair))
    needed = int(routing_map_TE.sum(dim=0).max()) if num_tokens else 0
    if capacity_factor == 0:
        return max(1, needed)
    return max(1, min(needed, math.ceil(-capacity_factor * fair)))


def apply_capacity(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, capacity: int,
                   drop_policy: str = "probs") -> tuple[torch.Tensor, torch.Tensor]:
    """(probs_TE, routing_map_TE) with the assignments beyond `capacity` per expert removed."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"--moe-token-drop-policy must be one of {DROP_POLICIES}, "
                         f"got {drop_policy!r}")
    num_tokens = routing_map_TE.shape[0]
    if capacity >= num_tokens:
        return probs_TE, routing_map_TE
    if drop_policy == "probs":
        ranked_TE = probs_TE.detach().masked_fill(~routing_map_TE, float("-inf"))
        idx_CE = ranked_TE.topk(capacity, dim=0).indices
        within_TE = torch.zeros_like(routing_map_TE).scatter(0, idx_CE, True)
    else:
        position_TE = routing_map_TE.to(torch.int32).cumsum(dim=0)  # 1-based slot per expert
        within_TE = position_TE <= capacity
    keep_TE = routing_map_TE & within_TE
    return probs_TE * keep_TE, keep_TE
