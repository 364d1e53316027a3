"""Which decoder layers each pipeline rank holds in a planned layout, how unevenly the work
falls on the ranks, and the uneven first / last split that evens it out.

A pipeline runs at the pace of its slowest rank. The last rank also runs the output layer
and its loss (and DeepSeek-V3's MTP depths), so an even split of the decoder layers is not
an even split of the work; and a layer count PP does not divide (DeepSeek-V3's 61) has no
even split at all. Megatron's answer is --decoder-first/last-pipeline-num-layers (the
first / last rank take fewer or more layers, the middle ranks share the rest evenly); the
planner searches those flags for the split whose busiest rank does the least work, counted
in the FLOPs of model/flops.py.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from megamoe.config import ModelConfig
from megamoe.model.flops import _all_layer_params, attention_core_width


def virtual_stage_counts(num_layers: int, pp: int, vpp: int,
                         split: Optional[tuple[int, ...]]) -> tuple[int, ...]:
    """Decoder layers of each virtual stage v = chunk x PP + rank (`split`, or even)."""
    if split is not None:
        return split
    return (num_layers // (pp * vpp),) * (pp * vpp)


@lru_cache(maxsize=4096)
def layer_ranks(num_layers: int, pp: int, vpp: int,
                split: Optional[tuple[int, ...]]) -> tuple[int, ...]:
    """[layer] -> the pipeline rank holding it (cached: the planner asks per layer, for
    thousands of layouts)."""
    out: list[int] = []
    for v, n in enumerate(virtual_stage_counts(num_layers, pp, vpp, split)):
        out += [v % pp] * n
    return tuple(out)


def rank_layer_counts(num_layers: int, pp: int, vpp: int,
                      split: Optional[tuple[int, ...]]) -> list[int]:
    """Decoder layers per pipeline rank, all its chunks together."""
    counts = [0] * pp
    for v, n in enumerate(virtual_stage_counts(num_layers, pp, vpp, split)):
        counts[v % pp] += n
    return counts


def _layer_flops(model: ModelConfig) -> list[float]:
    """Forward + backward FLOPs per token of each decoder layer, then each MTP depth
    (flops_per_token's terms, layer by layer)."""
    core = 6 * model.seq_length * attention_core_width(model)
    return [6.0 * mm + core for _, _, mm in _all_layer_params(model)]


def rank_flops(model: ModelConfig, pp: int, vpp: int, split: Optional[tuple[int, ...]],
               per_layer: Optional[list[float]] = None) -> list[float]:
    """FLOPs per token each pipeline rank runs: its decoder layers; the last rank also the
    MTP depths and the output layer once per prediction (1 + MTP depths). `per_layer`:
    _layer_flops(model), when the caller already has it."""
    per_layer = _layer_flops(model) if per_layer is None else per_layer
    out = [0.0] * pp
    for i, r in enumerate(layer_ranks(model.num_layers, pp, vpp, split)):
        out[r] += per_layer[i]
    out[-1] += sum(per_layer[model.num_layers:])
    out[-1] += 6.0 * model.vocab_size * model.hidden_size * (1 + model.num_mtp_layers)
    return out


def imbalance(model: ModelConfig, pp: int, vpp: int, split: Optional[tuple[int, ...]],
              per_layer: Optional[list[float]] = None) -> float:
    """The busiest rank's work over the mean: how much slower than a perfectly balanced
    pipeline this split runs (1 without pipelining)."""
    if pp == 1:
        return 1.0
    work = rank_flops(model, pp, vpp, split, per_layer)
    return max(work) * pp / sum(work)


def first_last_split(num_layers: int, pp: int, first: Optional[int],
                     last: Optional[int]) -> Optional[tuple[int, ...]]:
    """Per-rank counts of --decoder-first/last-pipeline-num-layers, or None where Megatron
    refuses them (a middle rank with no layers, or a remainder the middle cannot share)."""
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    if middle_layers < 0 or bool(middle_layers) != bool(middle) or (
            middle and middle_layers % middle):
        return None
    per = middle_layers // middle if middle else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts) if min(counts) >= 1 else None


def best_first_last(model: ModelConfig, pp: int) -> Optional[tuple[int, ...]]:
    """The --decoder-first/last-pipeline-num-layers split (VPP 1) whose busiest rank does
    the least work; ties go to the split closest to even. None when PP is 1 or no uneven
    split is both legal and better balanced than the even one (if there is one)."""
    n = model.num_layers
    if pp == 1 or n < pp:
        return None
    even = (n // pp,) * pp if n % pp == 0 else None
    per_layer = _layer_flops(model)
    best, best_key = None, None
    options = [None, *range(1, n)]
    for first in options:
        for last in options:
            if first is None and last is None:
                continue
            split = first_last_split(n, pp, first, last)
            if split is None or split == even:
                continue
            key = (imbalance(model, pp, 1, split, per_layer), max(split) - min(split))
            if best_key is None or key < best_key:
                best, best_key = split, key
    if best is None or (even is not None and
                        best_key[0] >= imbalance(model, pp, 1, even, per_layer)):
        return None
    return best


def first_last_flags(split: tuple[int, ...]) -> list[str]:
    """The --decoder-first/last-pipeline-num-layers flags that give `split` (one chunk per
    rank; first / last differ from the middle ranks' equal share)."""
    pp = len(split)
    if pp == 2:
        return [f"--decoder-first-pipeline-num-layers={split[0]}"]
    flags = []
    if split[0] != split[1]:
        flags.append(f"--decoder-first-pipeline-num-layers={split[0]}")
    if split[-1] != split[1]:
        flags.append(f"--decoder-last-pipeline-num-layers={split[-1]}")
    return flags
