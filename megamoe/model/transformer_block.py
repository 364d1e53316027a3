"""Pre-norm transformer layers and the decoder stack.

layer(x) = x + drop(attn(norm1(x))), then x + drop(mlp(norm2(x))); the MLP is an MoE layer
where `config.is_moe_layer(i)`. The block ends with the final norm.

With sequence parallelism the residual stream, norms and dropout live on [S/TP, B, H]
shards. An MoE layer sees the whole sequence (all-gathered), so routing equals
single-process, and its output is split back. The split's backward all-gathers the output
gradient, so every TP rank computes the same full gradient for the router: it needs no TP
reduction, and the aux losses (computed on the full sequence) are counted exactly once.
Once apply_expert_parallel gave the layer a `tensor_parallel` plan, the layer splits the
expert work over TP itself (moe/expert_tensor_parallel.py) and returns its shard; without
one its experts are replicated and every TP rank computes all of them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.attention import SelfAttention
from megamoe.model.mlp import MLP
from megamoe.model.norms import build_norm
from megamoe.parallel.comm import gather_from_sequence, scatter_to_sequence
from megamoe.parallel.tensor_parallel import SINGLE, TensorParallel, mark_sequence_parallel


def build_mlp(config: ModelConfig, layer_index: int, tp: TensorParallel = SINGLE) -> nn.Module:
    """Dense MLP or MoE layer for layer `layer_index` (0-based, as the MoE loss tracker)."""
    if not config.is_moe_layer(layer_index):
        return MLP(config, tp)
    # Imported here so dense models never depend on the MoE package.
    from megamoe.moe.layer import MoELayer

    return MoELayer(config.moe, config.hidden_size, layer_number=layer_index,
                    num_layers=config.num_layers, init_method_std=config.init_method_std,
                    add_bias_linear=config.add_bias_linear, swiglu=config.swiglu)


class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_index = layer_index
        self.tp = tp
        self.input_layernorm = mark_sequence_parallel(build_norm(config, config.hidden_size), tp)
        self.self_attention = SelfAttention(config, tp)
        self.pre_mlp_layernorm = mark_sequence_parallel(
            build_norm(config, config.hidden_size), tp)
        self.is_moe = config.is_moe_layer(layer_index)
        self.mlp = build_mlp(config, layer_index, tp)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def _mlp(self, x_SBH: torch.Tensor) -> torch.Tensor:
        if not (self.is_moe and self.tp.sp):
            return self.mlp(x_SBH)
        full_SBH = gather_from_sequence(x_SBH, self.tp.group, reduce_grad=False)
        if self.mlp.tensor_parallel is not None:  # returns its own [S/TP, B, H] shard
            return self.mlp(full_SBH)
        return scatter_to_sequence(self.mlp(full_SBH), self.tp.group)  # [S/TP, B, H]

    def _dropout(self, x_SBH: torch.Tensor) -> torch.Tensor:
        with self.tp.dropout_rng(split=self.tp.sp):  # SP shards: per-rank masks
            return self.dropout(x_SBH)

    def forward(self, x_SBH: torch.Tensor,
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        x_SBH = x_SBH + self._dropout(self.self_attention(self.input_layernorm(x_SBH), rotary))
        return x_SBH + self._dropout(self._mlp(self.pre_mlp_layernorm(x_SBH)))


class TransformerBlock(nn.Module):
    """`num_layers` layers then the final norm; [S, B, H] in and out ([S/TP, B, H] with SP)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config, i, tp)
                                    for i in range(config.num_layers))
        self.final_layernorm = mark_sequence_parallel(build_norm(config, config.hidden_size),
                                                      tp)

    def forward(self, x_SBH: torch.Tensor,
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        for layer in self.layers:
            x_SBH = layer(x_SBH, rotary)
        return self.final_layernorm(x_SBH)
