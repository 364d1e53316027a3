"""Mixture-of-Experts hot path: router, balancing losses, capacity, permutation, grouped
GEMM, experts, token dispatchers, the layer."""

from megamoe.moe.capacity import apply_capacity, expert_capacity
from megamoe.moe.experts import GroupedExperts, SequentialExperts, SharedExpertMLP
from megamoe.moe.global_batch import start_global_batch, update_expert_biases
from megamoe.moe.grouped_gemm import available_backends, grouped_mm
from megamoe.moe.layer import MoELayer
from megamoe.moe.losses import (
    MoELossTracker,
    attach_aux_loss,
    global_load_balancing_loss,
    sequence_load_balancing_loss,
    set_aux_loss_backward_scale,
    switch_load_balancing_loss,
    z_loss,
)
from megamoe.moe.permute import permute, permute_probs, unpermute
from megamoe.moe.router import (
    TopKRouter,
    expert_choice_routing,
    sinkhorn,
    sinkhorn_routing,
    topk_routing,
)
from megamoe.moe.stats import routing_stats

__all__ = [
    "GroupedExperts", "MoELayer", "MoELossTracker", "SequentialExperts", "SharedExpertMLP",
    "TopKRouter", "apply_capacity", "attach_aux_loss", "available_backends",
    "expert_capacity", "expert_choice_routing", "global_load_balancing_loss", "grouped_mm",
    "permute", "permute_probs", "routing_stats", "sequence_load_balancing_loss",
    "set_aux_loss_backward_scale", "sinkhorn", "sinkhorn_routing", "start_global_batch",
    "switch_load_balancing_loss", "topk_routing", "unpermute", "update_expert_biases",
    "z_loss",
]
