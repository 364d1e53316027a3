"""Common part of the expert-parallel dispatchers: which experts this rank owns.

With expert parallelism of size EP, rank r of the ep group owns the E_local = E / EP
experts [r * E_local, (r + 1) * E_local). The router still scores all E experts on every
rank; the dispatcher moves each token copy to the rank that owns its expert and the
combine brings the expert outputs back, weighted by the router probabilities. Every
collective is autograd-aware, so gradients reach the router probabilities, the tokens and
the experts exactly; ranks or experts that receive no token work (zero-size splits).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megamoe.moe.dispatchers.base import TokenDispatcher
from megamoe.parallel.comm import group_rank, group_size


class ExpertParallelDispatcher(TokenDispatcher):
    def __init__(self, num_experts: int, ep_group: Optional[dist.ProcessGroup]) -> None:
        self.group = ep_group
        self.ep_size, self.ep_rank = group_size(ep_group), group_rank(ep_group)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.local_start = self.ep_rank * self.num_local_experts
