"""Mixture-of-Experts hot path: router, balancing losses, permutation, grouped GEMM, layer."""

from megamoe.moe.experts import GroupedExperts
from megamoe.moe.grouped_gemm import available_backends, grouped_mm
from megamoe.moe.layer import MoELayer
from megamoe.moe.losses import (
    MoELossTracker,
    attach_aux_loss,
    set_aux_loss_backward_scale,
    switch_load_balancing_loss,
    z_loss,
)
from megamoe.moe.permute import permute, permute_probs, unpermute
from megamoe.moe.router import TopKRouter, topk_routing

__all__ = [
    "GroupedExperts", "MoELayer", "MoELossTracker", "TopKRouter", "attach_aux_loss",
    "available_backends", "grouped_mm", "permute", "permute_probs", "set_aux_loss_backward_scale",
    "switch_load_balancing_loss", "topk_routing", "unpermute", "z_loss",
]
