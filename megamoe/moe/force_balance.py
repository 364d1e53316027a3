"""Megatron's --moe-router-force-load-balancing (a benchmarking mode): the router's logits
are replaced by standard-normal noise before scoring and top-k, so every expert receives
about the same number of tokens whatever the weights have learned. The gate's gradient
passes straight through (Megatron's RandomSTE), so the step's compute and communication
are those of a perfectly balanced model. Never for a run whose loss matters.

The noise comes from a stream of its own per expert-parallel rank (Megatron forks its
expert-parallel RNG tracker), seeded by parallelize; an RNGTracker is saved and restored
by activation recompute like the dropout streams, so a recomputed forward routes the
same way.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megamoe.parallel.rng import RNGTracker

# Megatron's expert-parallel seed: seed + 1024 + 100 * ep_rank + etp_rank.
EXPERT_SEED_OFFSET = 1024


def expert_parallel_seed(seed: int, ep_rank: int, etp_rank: int, pp_offset: int) -> int:
    return seed + pp_offset + EXPERT_SEED_OFFSET + 100 * ep_rank + etp_rank


class RandomLogits(torch.autograd.Function):
    """Forward: noise shaped like the logits; backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, logits_TE: torch.Tensor, rng: Optional[RNGTracker]) -> torch.Tensor:
        with rng.fork() if rng is not None else contextlib.nullcontext():
            return torch.randn_like(logits_TE)

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor):
        return grad_TE, None


def random_logits(logits_TE: torch.Tensor, rng: Optional[RNGTracker] = None) -> torch.Tensor:
    return RandomLogits.apply(logits_TE, rng)
