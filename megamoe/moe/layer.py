"""MoELayer: router -> dispatch (permute) -> experts -> combine (unpermute) -> aux loss.

Dispatch, compute and combine are separate methods with no communication inside, so an
expert-parallel token dispatcher can wrap dispatch/combine later without touching the math.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn

from megamoe.config import MoEConfig
from megamoe.moe.experts import GroupedExperts
from megamoe.moe.losses import attach_aux_loss
from megamoe.moe.permute import permute, permute_probs, unpermute
from megamoe.moe.router import TopKRouter


class Dispatched(NamedTuple):
    x_NH: torch.Tensor  # token copies grouped by expert
    probs_N: torch.Tensor  # combine weight of each copy
    token_indices_N: torch.Tensor  # source token of each copy
    tokens_per_expert_E: torch.Tensor
    num_tokens: int


def _check_supported(config: MoEConfig) -> None:
    """Refuse features this layer does not implement instead of silently ignoring them."""
    unsupported = {
        "--moe-expert-capacity-factor": config.capacity_factor is not None,
        "--moe-pad-expert-input-to-capacity": config.pad_to_capacity,
        "--moe-input-jitter-eps": config.input_jitter_eps is not None,
        "--moe-router-enable-expert-bias": config.enable_expert_bias,
        "--moe-shared-expert-intermediate-size":
            config.shared_expert_intermediate_size is not None,
    }
    bad = [flag for flag, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"MoELayer does not support {', '.join(bad)} yet")


class MoELayer(nn.Module):
    """Dropless token-choice MoE block replacing the dense MLP; all experts are local."""

    def __init__(self, config: MoEConfig, hidden_size: int, *, layer_number: int,
                 num_layers: int, init_method_std: float, add_bias_linear: bool,
                 swiglu: bool) -> None:
        super().__init__()
        _check_supported(config)
        self.config = config
        self.hidden_size = hidden_size
        self.layer_number = layer_number
        self.router = TopKRouter(hidden_size, config, layer_number, num_layers,
                                 init_method_std)
        self.experts = GroupedExperts(
            config.num_experts, hidden_size, config.ffn_hidden_size, swiglu=swiglu,
            add_bias=add_bias_linear, init_method_std=init_method_std,
            output_init_std=init_method_std / math.sqrt(2.0 * num_layers),
            grouped_gemm=config.grouped_gemm)
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts,
                                                              dtype=torch.long),
                             persistent=False)

    def dispatch(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                 routing_map_TE: torch.Tensor) -> Dispatched:
        x_NH, token_indices_N, tokens_per_expert_E = permute(x_TH, routing_map_TE)
        probs_N = permute_probs(probs_TE, routing_map_TE)
        return Dispatched(x_NH, probs_N, token_indices_N, tokens_per_expert_E, x_TH.shape[0])

    def compute(self, d: Dispatched) -> torch.Tensor:
        return self.experts(d.x_NH, d.tokens_per_expert_E)

    def combine(self, y_NH: torch.Tensor, d: Dispatched) -> torch.Tensor:
        return unpermute(y_NH, d.token_indices_N, d.probs_N, d.num_tokens)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H] (typically [S, B, H])."""
        shape = hidden.shape
        x_TH = hidden.reshape(-1, self.hidden_size)
        probs_TE, routing_map_TE, aux_loss = self.router.route(x_TH)
        d = self.dispatch(x_TH, probs_TE, routing_map_TE)
        self.tokens_per_expert = d.tokens_per_expert_E.detach()
        out_TH = self.combine(self.compute(d), d)
        if aux_loss is not None:
            out_TH = attach_aux_loss(out_TH, aux_loss)
        return out_TH.reshape(shape)
