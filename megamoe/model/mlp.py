"""Dense feed-forward block: fc1 -> (swiglu | gelu) -> fc2.

Under tensor parallelism fc1 is column-parallel and fc2 row-parallel. With swiglu the gate
and up halves are split separately, so rank r's fc1 shard is [gate_r; up_r] and the local
`chunk(2)` still pairs each gate column with its own up column.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.config import ModelConfig
from megamoe.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """Megatron MLP. With swiglu, `linear_fc1.weight` [2F, H] stacks gate (rows :F, HF
    gate_proj / w1) over up (rows F:, HF up_proj / w3): one GEMM instead of two."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.swiglu = config.swiglu
        std = config.init_method_std
        self.linear_fc1 = ColumnParallelLinear(
            h, 2 * f if self.swiglu else f, bias=config.add_bias_linear, init_std=std,
            blocks=(f, f) if self.swiglu else None)
        self.linear_fc2 = RowParallelLinear(
            f, h, bias=config.add_bias_linear,
            init_std=std / math.sqrt(2.0 * config.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)  # [..., F or 2F] (local: / TP)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)
