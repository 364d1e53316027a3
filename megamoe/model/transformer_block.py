"""Pre-norm transformer layers and the decoder stack.

layer(x) = x + drop(attn(norm1(x))), then x + drop(mlp(norm2(x))); the MLP is an MoE layer
where `config.is_moe_layer(i)`. The block ends with the final norm.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.attention import SelfAttention
from megamoe.model.mlp import MLP
from megamoe.model.norms import build_norm


def build_mlp(config: ModelConfig, layer_index: int) -> nn.Module:
    """Dense MLP or MoE layer for layer `layer_index` (0-based, as the MoE loss tracker)."""
    if not config.is_moe_layer(layer_index):
        return MLP(config)
    # Imported here so dense models never depend on the MoE package.
    from megamoe.moe.layer import MoELayer

    return MoELayer(config.moe, config.hidden_size, layer_number=layer_index,
                    num_layers=config.num_layers, init_method_std=config.init_method_std,
                    add_bias_linear=config.add_bias_linear, swiglu=config.swiglu)


class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.input_layernorm = build_norm(config, config.hidden_size)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size)
        self.mlp = build_mlp(config, layer_index)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x_SBH: torch.Tensor,
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        x_SBH = x_SBH + self.dropout(self.self_attention(self.input_layernorm(x_SBH), rotary))
        return x_SBH + self.dropout(self.mlp(self.pre_mlp_layernorm(x_SBH)))


class TransformerBlock(nn.Module):
    """`num_layers` layers then the final norm; [S, B, H] in and out."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config, i) for i in range(config.num_layers))
        self.final_layernorm = build_norm(config, config.hidden_size)

    def forward(self, x_SBH: torch.Tensor,
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        for layer in self.layers:
            x_SBH = layer(x_SBH, rotary)
        return self.final_layernorm(x_SBH)
