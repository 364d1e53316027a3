"""Routing statistics per MoE layer, and the adaptive-parallelism mode counts, for the
logger.

Each MoELayer accumulates, over its training forwards, the assignments the router made
per expert (before capacity) and those kept (after capacity). `routing_stats` reads and
(by default) resets them, so calling it once per logging interval gives that interval's
statistics.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch

from megamoe.moe.cost_model import predict_mode_seconds
from megamoe.moe.dispatchers import AdaptiveDispatcher
from megamoe.moe.layer import MoELayer


def _layers(model: torch.nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def routing_stats(model: torch.nn.Module, reset: bool = True) -> dict[int, dict]:
    """{layer_number: stats} for every MoE layer that saw training tokens since the last read.

    stats: tokens_per_expert (kept assignments, list of ints), routed_per_expert (before
    capacity), num_tokens, dropped_fraction (dropped / routed assignments), max_load,
    mean_load (kept assignments per expert) and max_over_mean_load (1.0 = perfect balance).
    """
    out: dict[int, dict] = {}
    for layer in _layers(model):
        num_tokens = float(layer.stat_num_tokens)
        if num_tokens == 0:
            continue
        kept_E = layer.stat_kept_per_expert.double()
        routed = float(layer.stat_routed_per_expert.sum())
        mean_load = float(kept_E.mean())
        max_load = float(kept_E.max())
        out[layer.layer_number] = {
            "tokens_per_expert": [int(v) for v in kept_E.tolist()],
            "routed_per_expert": [int(v) for v in layer.stat_routed_per_expert.tolist()],
            "num_tokens": int(num_tokens),
            "dropped_fraction": (routed - float(kept_E.sum())) / routed if routed else 0.0,
            "max_load": max_load,
            "mean_load": mean_load,
            "max_over_mean_load": max_load / mean_load if mean_load else 0.0,
        }
        if reset:
            layer.stat_kept_per_expert.zero_()
            layer.stat_routed_per_expert.zero_()
            layer.stat_num_tokens.zero_()
    return out


def routing_counts(model: torch.nn.Module, reset: bool = True
                   ) -> tuple[list[int], Optional[torch.Tensor]]:
    """(layer numbers, [layers, 2, experts] kept and routed assignment counts, float64 on
    the layers' device) of every MoE layer since the last read, None without MoE layers.
    The training loop's per-step read: nothing comes back to the host (a layer that saw no
    tokens is a zero row, where `routing_stats` leaves it out after reading the count)."""
    layers = _layers(model)
    if not layers:
        return [], None
    both_L2E = torch.stack([torch.stack([layer.stat_kept_per_expert,
                                         layer.stat_routed_per_expert]) for layer in layers])
    both_L2E = both_L2E.to(torch.float64)  # a copy: the resets below do not touch it
    if reset:
        for layer in layers:
            layer.stat_kept_per_expert.zero_()
            layer.stat_routed_per_expert.zero_()
            layer.stat_num_tokens.zero_()
    return [layer.layer_number for layer in layers], both_L2E


def _adaptive(layer: MoELayer) -> Optional[AdaptiveDispatcher]:
    return next((d for d in layer.dispatcher.inner_dispatchers()
                 if isinstance(d, AdaptiveDispatcher)), None)


def mode_counts(model: torch.nn.Module, reset: bool = True) -> Counter:
    """Training calls per adaptive-parallelism mode over all MoE layers since the last read
    (for the logger)."""
    total: Counter = Counter()
    for layer in _layers(model):
        adaptive = _adaptive(layer)
        if adaptive is not None:
            total.update(adaptive.mode_counts)
            if reset:
                adaptive.mode_counts.clear()
    return total


def describe_choice(model: torch.nn.Module, num_tokens: int) -> str:
    """'predicted ep 1.20 ms, ...; measured ep 3.1 ms, ... -> ep' for the first adaptive
    layer (a collective over its ep group when it calibrates: call it on every rank)."""
    for layer in _layers(model):
        ex = _adaptive(layer)
        if ex is None:
            continue
        if ex.costs is None:
            return "no cost model (mode chosen per call)"
        args = (layer.experts, num_tokens, layer.hidden_size, layer.config.num_experts)
        seconds = predict_mode_seconds(ex.costs, ex.cost_inputs(*args))
        shown = ", ".join(f"{m} {1e3 * s:.2f} ms" for m, s in seconds.items())
        mode = ex.choose(*args)
        measured = ex.timings.get(num_tokens)
        if measured:
            shown += "; measured " + ", ".join(f"{m} {1e3 * s:.2f} ms"
                                               for m, s in measured.items())
        return f"predicted {shown} -> {mode}"
    return "no expert-parallel MoE layer on this rank"
