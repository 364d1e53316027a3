"""Routing statistics per MoE layer, for the logger.

Each MoELayer accumulates, over its training forwards, the assignments the router made
per expert (before capacity) and those kept (after capacity). `routing_stats` reads and
(by default) resets them, so calling it once per logging interval gives that interval's
statistics.
"""

from __future__ import annotations

import torch

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


def flat_routing_stats(model: torch.nn.Module, reset: bool = True) -> dict[str, float]:
    """Scalars for TensorBoard/W&B: moe/layer_{i}/{dropped_fraction,max_over_mean_load}."""
    out = {}
    for i, s in routing_stats(model, reset).items():
        out[f"moe/layer_{i}/dropped_fraction"] = s["dropped_fraction"]
        out[f"moe/layer_{i}/max_over_mean_load"] = s["max_over_mean_load"]
    return out
