"""--moe-router-padding-for-quantization (Megatron-LM's, alias --moe-router-padding-for-fp8):
every expert receives a multiple of the FP8 GEMM's alignment in tokens, so the grouped
GEMMs need no padding of their own.

As Megatron's pad_routing_map (megatron/core/transformer/moe/moe_utils.py), applied by the
layer to the routing map of the tokens this rank routes, after the router (the aux loss,
the expert-bias counts and the token statistics see the real assignments): each expert's
column gains the first tokens not yet routed to it until its count is a multiple of the
alignment (fewer if the tokens run out). Those extra assignments carry probability 0
(probs are zero off the routing map), so their expert outputs are multiplied by 0 in the
combine: the layer's output is the unpadded one. Under expert parallelism each rank pads
its own map, so the count an expert receives, a sum of multiples, is a multiple too.
The alignment is Megatron's get_fp8_align_size: 32 for mxfp8, 16 otherwise.
"""

from __future__ import annotations

import torch


def quantization_alignment(recipe: str) -> int:
    """Tokens per expert must be a multiple of this for the FP8 recipe's grouped GEMMs."""
    return 32 if recipe == "mxfp8" else 16


def pad_routing_map(routing_map_TE: torch.Tensor, multiple: int) -> torch.Tensor:
    """A new bool routing map in which each expert's token count is rounded up to a
    multiple of `multiple` by routing it the first tokens it did not have (on the device:
    no host synchronisation)."""
    map_ET = routing_map_TE.bool().t()
    to_pad_E = (-map_ET.sum(dim=1)) % multiple
    free_ET = ~map_ET
    rank_ET = torch.cumsum(free_ET.int(), dim=1)  # 1-based rank among the free tokens
    extra_ET = free_ET & (rank_ET <= to_pad_E.unsqueeze(1))
    return (map_ET | extra_ET).t()
