"""Routed experts as stacked weights driven by one grouped GEMM per projection.

The same parameters serve the grouped backends and the per-expert loop (Megatron's
SequentialMLP), so `--moe-grouped-gemm` changes speed, never the math or checkpoints.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megamoe.moe.activations import apply_activation, check_activation, is_gated
from megamoe.moe.grouped_gemm import Sizes, as_group_sizes, gather_grouped_mm, grouped_mm
from megamoe.moe.swiglu import swiglu
from megamoe.parallel.checkpointing import maybe_discard
from megamoe.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _rows_bias(bias_EM: Optional[torch.Tensor], tokens_per_expert_E: torch.Tensor,
               num_rows: int) -> Optional[torch.Tensor]:
    """Per-row bias [N, M]: expert e's bias repeated over its rows (grouped GEMMs have none)."""
    if bias_EM is None:
        return None
    return torch.repeat_interleave(bias_EM, tokens_per_expert_E.to(bias_EM.device), dim=0,
                                   output_size=num_rows)


def resolve_activation(swiglu: bool, activation: Optional[str]) -> str:
    """The experts' activation: `activation` (moe/activations.py) when given, else swiglu
    or gelu per `swiglu`; the two must agree (swiglu=True names the fused SwiGLU)."""
    if activation is None:
        return "swiglu" if swiglu else "gelu"
    if (check_activation(activation) == "swiglu") != swiglu:
        raise ValueError(f"experts: activation {activation!r} with swiglu={swiglu}")
    return activation


class GroupedExperts(nn.Module):
    """num_local_experts MLPs: fc1 [E, H, F or 2F] -> act -> fc2 [E, F, H].

    `fuses_gather`: the first GEMM can take the [T, H] tokens plus the row -> token
    indices instead of gathered rows. `combine_in_experts`: the experts are linear after
    the activation, so the combine weights can scale the [N, F] activation instead of the
    [N, H] output: with SwiGLU the fused op (swiglu.py) applies them for free and keeps only
    fc1's output; otherwise it pays when F <= H (the multiply and what autograd keeps are F
    wide, not H).
    """

    fuses_gather = True

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, *,
                 swiglu: bool, add_bias: bool, init_method_std: float, output_init_std: float,
                 grouped_gemm: bool, activation: Optional[str] = None) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        # Set when the experts are sharded (moe/sharding.py): the
        # global id of local expert 0, and this rank's slice of the hidden dimension F.
        self.expert_offset = 0
        self.etp_size, self.etp_rank = 1, 0
        self.fc2_bias_scale = 1.0  # 1 / ETP: each etp rank adds its share of the fc2 bias
        self.init_stds = {"fc1_weight": init_method_std, "fc2_weight": output_init_std}
        self.activation_name = resolve_activation(swiglu, activation)
        self.swiglu = swiglu
        self.gated = is_gated(self.activation_name)  # fc1 = [gate | up]
        self.combine_in_experts = swiglu or ffn_hidden_size <= hidden_size
        self.backend = "auto" if grouped_gemm else "loop"
        self.recompute_act = False  # --recompute-modules moe_act (parallelize sets it)
        # FP8 grouped GEMM (x_NK, w_EKM, GroupSizes) -> y_NM, set by the FP8 policy
        self.fp8 = None
        fc1_out = 2 * ffn_hidden_size if self.gated else ffn_hidden_size
        # Gated fc1 columns: [:F] = gate (HF w1), [F:] = up (HF w3).
        self.fc1_weight = nn.Parameter(torch.empty(num_local_experts, hidden_size, fc1_out))
        self.fc2_weight = nn.Parameter(torch.empty(num_local_experts, ffn_hidden_size,
                                                   hidden_size))
        self.fc1_bias = nn.Parameter(torch.zeros(num_local_experts, fc1_out)) if add_bias else None
        self.fc2_bias = (nn.Parameter(torch.zeros(num_local_experts, hidden_size))
                         if add_bias else None)
        nn.init.normal_(self.fc1_weight, mean=0.0, std=init_method_std)
        nn.init.normal_(self.fc2_weight, mean=0.0, std=output_init_std)

    def _weighted_activation(self, h_NF: torch.Tensor, p_N: Optional[torch.Tensor]
                             ) -> torch.Tensor:
        """act(h) (* p per row). SwiGLU runs fused: autograd keeps h_NF only, not the
        [N, F] intermediates."""
        if self.swiglu:
            return swiglu(h_NF, p_N)
        a_NF = self.activation(h_NF)
        return a_NF if p_N is None else a_NF * p_N.unsqueeze(-1)

    def activation(self, h_NF: torch.Tensor) -> torch.Tensor:
        return apply_activation(self.activation_name, h_NF)

    def forward(self, x_NH: torch.Tensor, tokens_per_expert_E: Sizes,
                probs_N: Optional[torch.Tensor] = None,
                token_indices_N: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x_NH grouped by expert (rows of expert e contiguous) -> y_NH in the same order.

        With `token_indices_N`, x is the [T, H] token tensor and row n is token
        token_indices_N[n]: the gather is fused into fc1 (not kept for backward).
        With `probs_N` the rows come out weighted: p * (a @ W2 + b2) = (p * a) @ W2 + p * b2,
        applied to the [N, F] activation instead of the [N, H] output, which for
        fine-grained experts (F < H) saves both the multiply and the memory autograd keeps.
        The group sizes are a tensor or a GroupSizes (grouped_gemm.py); both GEMMs share
        one GroupSizes, so a backend that needs the sizes on the host (grouped_gemm, loop)
        copies them at most once per call, not once per GEMM, and never when the
        dispatcher handed them over on the host already.
        """
        sizes = as_group_sizes(tokens_per_expert_E)
        if token_indices_N is not None and self.fp8 is not None:
            x_NH, token_indices_N = x_NH[token_indices_N], None  # FP8 quantises rows
        if token_indices_N is None:
            num_rows = x_NH.shape[0]
            h_NF = self._mm(x_NH, self.fc1_weight, sizes)
        else:
            num_rows = token_indices_N.shape[0]
            h_NF = gather_grouped_mm(x_NH, token_indices_N, self.fc1_weight, sizes,
                                     self.backend)
        b1_NF = _rows_bias(self.fc1_bias, sizes.device_E, num_rows)
        if b1_NF is not None:
            h_NF = h_NF + b1_NF
        p_N = None if probs_N is None else probs_N.to(h_NF.dtype)
        p_N1 = None if p_N is None else p_N.unsqueeze(-1)
        a_NF = self._weighted_activation(h_NF, p_N)
        # moe_act: fc2 does not keep a_NF; backward recomputes it from h_NF (kept anyway).
        with maybe_discard(self.recompute_act, a_NF,
                           lambda: self._weighted_activation(h_NF, p_N)):
            y_NH = self._mm(a_NF, self.fc2_weight, sizes)
        b2_NH = _rows_bias(self.fc2_bias, sizes.device_E, num_rows)
        if b2_NH is None:
            return y_NH
        if self.fc2_bias_scale != 1.0:
            b2_NH = b2_NH * self.fc2_bias_scale
        return y_NH + (b2_NH if p_N1 is None else b2_NH * p_N1)

    def _mm(self, x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes) -> torch.Tensor:
        """One projection's grouped GEMM: FP8 when the FP8 policy set one, else the
        backend's."""
        if self.fp8 is not None:
            return self.fp8(x_NK, w_EKM, sizes)
        return grouped_mm(x_NK, w_EKM, sizes, self.backend)


def use_grouped_gemm(model: nn.Module, enabled: bool) -> None:
    """--moe-grouped-gemm for every GroupedExperts in `model`: one grouped GEMM per weight
    (the best backend available, grouped_gemm.py) or the per-expert loop. Speed only."""
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.backend = "auto" if enabled else "loop"


class SequentialExperts(nn.Module):
    """User-supplied expert modules (Tutel / FastMoE style), run one after another.

    Each module maps [n, H] -> [n, H]; any architecture works. Slower than the grouped
    path (one call per expert) but free-form; the split sizes are needed on the host (a
    device->host copy per call unless the dispatcher has them there: all-to-all).
    """

    def __init__(self, experts: list[nn.Module]) -> None:
        super().__init__()
        if not experts:
            raise ValueError("SequentialExperts needs at least one expert module")
        self.local_experts = nn.ModuleList(experts)
        self.num_local_experts = len(experts)
        self.expert_offset = 0  # global id of local expert 0 (set by expert parallelism)

    def forward(self, x_NH: torch.Tensor, tokens_per_expert_E: Sizes) -> torch.Tensor:
        chunks = torch.split(x_NH, as_group_sizes(tokens_per_expert_E).host_list(), dim=0)
        return torch.cat([expert(x_e) for expert, x_e in zip(self.local_experts, chunks)])


class SharedExpertMLP(nn.Module):
    """Dense MLP every token passes through, added to the routed output (DeepSeek/Qwen).

    As Megatron-Core's SharedExpertMLP, it is a tensor-parallel MLP over the dense TP group
    (not the expert one): fc1 column-parallel (with SwiGLU the gate and up halves split
    separately, as model/mlp.py), fc2 row-parallel. Under sequence parallelism it takes
    this rank's [S/TP, B, H] shard: fc1 gathers the sequence, fc2 reduce-scatters it back,
    so each TP rank holds and runs 1/TP of it. The parallelize step shards the linears
    (their `shard`); built whole (one rank) it draws exactly the single-process weights.

    With `gate`, the output is scaled by sigmoid(x @ gate_weight^T) per token, as
    Megatron-Core's --moe-shared-expert-gate: computed on the layer's input, so under SP on
    this rank's shard with the whole [1, H] gate replicated over TP; its gradient is then
    partial per shard and is marked `sequence_parallel` (summed over TP) by the parallelize
    step.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, swiglu: bool,
                 add_bias: bool, gate: bool, init_method_std: float,
                 output_init_std: float, activation: Optional[str] = None) -> None:
        super().__init__()
        self.activation_name = resolve_activation(swiglu, activation)
        self.swiglu = swiglu
        self.gated = is_gated(self.activation_name)
        self.linear_fc1 = ColumnParallelLinear(
            hidden_size, 2 * ffn_hidden_size if self.gated else ffn_hidden_size,
            bias=add_bias, init_std=init_method_std,
            blocks=(ffn_hidden_size, ffn_hidden_size) if self.gated else None)
        self.linear_fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias=add_bias,
                                            init_std=output_init_std)
        # Before they were split over TP these were replicated whole tensors: their TP
        # shards keep those tensors' seeded values and load their checkpoints
        # (training/checkpoint/sharded_state.py `whole_key`).
        self.linear_fc1.was_replicated = self.linear_fc2.was_replicated = True
        self.gate_weight = None
        self.init_stds = {"gate_weight": init_method_std}
        if gate:
            self.gate_weight = nn.Parameter(torch.empty(1, hidden_size))
            nn.init.normal_(self.gate_weight, mean=0.0, std=init_method_std)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """x_TH: the layer's input rows (under SP this rank's sequence shard) -> the same
        rows of the shared experts' output."""
        return self.fc2_forward(*self.fc1_forward(x_TH))

    def fc1_forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """First half (--moe-shared-expert-overlap runs it during the dispatch): fc1 and
        the activation, and the gate's score -> (activation, score or None)."""
        h_TF = self.linear_fc1(x_TH)  # [T (SP: gathered), F or 2F] (local: / TP)
        h_TF = apply_activation(self.activation_name, h_TF)
        score_T1 = None
        if self.gate_weight is not None:
            score_T1 = torch.sigmoid(F.linear(x_TH, self.gate_weight))  # [T, 1]
        return h_TF, score_T1

    def fc2_forward(self, h_TF: torch.Tensor, score_T1: Optional[torch.Tensor]
                    ) -> torch.Tensor:
        """Second half (during the combine under the overlap): fc2, scaled by the gate."""
        y_TH = self.linear_fc2(h_TF)  # summed over TP (SP: reduce-scattered to x's rows)
        return y_TH if score_T1 is None else y_TH * score_T1  # [T, 1] broadcast
