"""Dense feed-forward block: fc1 -> activation (moe/activations.py) -> fc2.

Under tensor parallelism fc1 is column-parallel and fc2 row-parallel. With a gated
activation (swiglu, quick_geglu) the gate and up halves are split separately, so rank r's
fc1 shard is [gate_r; up_r] and the local `chunk(2)` still pairs each gate column with its
own up column.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megamoe.config import ModelConfig
from megamoe.moe.activations import apply_activation
from megamoe.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """Megatron MLP. With swiglu, `linear_fc1.weight` [2F, H] stacks gate (rows :F, HF
    gate_proj / w1) over up (rows F:, HF up_proj / w3): one GEMM instead of two."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.activation = config.activation
        self.swiglu = config.swiglu
        self.gated = config.gated_linear_unit  # fc1 = [gate; up]
        std = config.init_method_std
        self.linear_fc1 = ColumnParallelLinear(
            h, 2 * f if self.gated else f, bias=config.add_bias_linear, init_std=std,
            blocks=(f, f) if self.gated else None)
        self.linear_fc2 = RowParallelLinear(
            f, h, bias=config.add_bias_linear,
            init_std=std / math.sqrt(2.0 * config.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)  # [..., F or 2F] (local: / TP)
        return self.linear_fc2(apply_activation(self.activation, h))
