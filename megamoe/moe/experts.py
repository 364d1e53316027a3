"""Routed experts as stacked weights driven by one grouped GEMM per projection.

The same parameters serve the grouped backends and the per-expert loop (Megatron's
SequentialMLP), so `--moe-grouped-gemm` changes speed, never the math or checkpoints.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megamoe.moe.grouped_gemm import grouped_mm


def _rows_bias(bias_EM: Optional[torch.Tensor], tokens_per_expert_E: torch.Tensor,
               num_rows: int) -> Optional[torch.Tensor]:
    """Per-row bias [N, M]: expert e's bias repeated over its rows (grouped GEMMs have none)."""
    if bias_EM is None:
        return None
    return torch.repeat_interleave(bias_EM, tokens_per_expert_E.to(bias_EM.device), dim=0,
                                   output_size=num_rows)


class GroupedExperts(nn.Module):
    """num_local_experts MLPs: fc1 [E, H, F or 2F] -> act -> fc2 [E, F, H]."""

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, *,
                 swiglu: bool, add_bias: bool, init_method_std: float, output_init_std: float,
                 grouped_gemm: bool) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.swiglu = swiglu
        self.backend = "auto" if grouped_gemm else "loop"
        fc1_out = 2 * ffn_hidden_size if swiglu else ffn_hidden_size
        # Swiglu fc1 columns: [:F] = gate (HF w1), [F:] = up (HF w3).
        self.fc1_weight = nn.Parameter(torch.empty(num_local_experts, hidden_size, fc1_out))
        self.fc2_weight = nn.Parameter(torch.empty(num_local_experts, ffn_hidden_size,
                                                   hidden_size))
        self.fc1_bias = nn.Parameter(torch.zeros(num_local_experts, fc1_out)) if add_bias else None
        self.fc2_bias = (nn.Parameter(torch.zeros(num_local_experts, hidden_size))
                         if add_bias else None)
        nn.init.normal_(self.fc1_weight, mean=0.0, std=init_method_std)
        nn.init.normal_(self.fc2_weight, mean=0.0, std=output_init_std)

    def activation(self, h_NF: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate_NF, up_NF = h_NF.chunk(2, dim=-1)
            return F.silu(gate_NF) * up_NF
        return F.gelu(h_NF)

    def forward(self, x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """x_NH grouped by expert (rows of expert e contiguous) -> y_NH in the same order."""
        num_rows = x_NH.shape[0]
        h_NF = grouped_mm(x_NH, self.fc1_weight, tokens_per_expert_E, self.backend)
        b1_NF = _rows_bias(self.fc1_bias, tokens_per_expert_E, num_rows)
        if b1_NF is not None:
            h_NF = h_NF + b1_NF
        a_NF = self.activation(h_NF)
        y_NH = grouped_mm(a_NF, self.fc2_weight, tokens_per_expert_E, self.backend)
        b2_NH = _rows_bias(self.fc2_bias, tokens_per_expert_E, num_rows)
        return y_NH if b2_NH is None else y_NH + b2_NH
