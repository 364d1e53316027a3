"""MoELayer: router -> capacity -> dispatch (permute) -> experts -> combine -> aux loss.

Dispatch, compute and combine are separate methods with no communication inside, so an
expert-parallel token dispatcher can wrap dispatch/combine later without touching the math.
The layer also works standalone (Tutel's `moe_layer`, FastMoE's `FMoE`): any [..., H]
input, built from keyword arguments, with stacked grouped experts or any list of modules.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from megamoe.config import MoEConfig
from megamoe.moe.capacity import apply_capacity, expert_capacity
from megamoe.moe.experts import GroupedExperts, SequentialExperts, SharedExpertMLP
from megamoe.moe.losses import attach_aux_loss
from megamoe.moe.permute import pad_groups, permute, permute_probs, unpermute
from megamoe.moe.router import TopKRouter


class Dispatched(NamedTuple):
    x_NH: torch.Tensor  # token copies grouped by expert (+ zero padding rows), or with
    # `gathered=False` the [T(+1), H] tokens that token_indices_N select (fused gather)
    probs_N: torch.Tensor  # combine weight of each copy (0 for padding)
    token_indices_N: torch.Tensor  # source token of each copy (num_tokens for padding)
    tokens_per_expert_E: torch.Tensor  # rows per expert group (capacity when padded)
    num_tokens: int
    padded: bool
    gathered: bool = True


class MoELayer(nn.Module):
    """Token-choice (dropless or capacity-bound) or expert-choice MoE block.

    Args (beyond the MoEConfig, which `**config_kwargs` can build instead):
      experts: optional list of nn.Module experts ([n, H] -> [n, H]) replacing the
        grouped SwiGLU/GELU experts; num_experts is then len(experts).
      grouped_gemm: run the experts as one grouped GEMM per weight (else a loop); the
        --moe-grouped-gemm execution setting, not part of the MoEConfig.
      sequence_dim: which input dim is the sequence for seq_aux_loss: 0 for Megatron's
        [S, B, H] (the GPT model), 1 for [B, S, H]; a 2-D input is one sequence.
      balancing_group / grad_average_size: see TopKRouter (global_aux_loss).
    """

    def __init__(self, config: Optional[MoEConfig] = None, hidden_size: Optional[int] = None,
                 *, layer_number: int = 0, num_layers: int = 1, init_method_std: float = 0.02,
                 add_bias_linear: bool = False, swiglu: bool = True,
                 experts: Optional[Sequence[nn.Module]] = None, sequence_dim: int = 0,
                 balancing_group: Optional[dist.ProcessGroup] = None,
                 grad_average_size: int = 1, grouped_gemm: bool = False,
                 **config_kwargs) -> None:
        super().__init__()
        if hidden_size is None:
            raise ValueError("MoELayer needs hidden_size")
        if config is None:
            if experts is not None:
                config_kwargs.setdefault("num_experts", len(experts))
            config = MoEConfig(**config_kwargs)
        elif config_kwargs:
            raise ValueError(f"pass either a MoEConfig or keyword options, not both "
                             f"({', '.join(config_kwargs)})")
        if experts is not None and len(experts) != config.num_experts:
            raise ValueError(f"{len(experts)} expert modules for num_experts="
                             f"{config.num_experts}")
        if sequence_dim not in (0, 1):
            raise ValueError(f"sequence_dim must be 0 ([S, B, H]) or 1 ([B, S, H]), "
                             f"got {sequence_dim}")
        self.config = config
        self.hidden_size = hidden_size
        self.layer_number = layer_number
        self.sequence_dim = sequence_dim
        self.router = TopKRouter(hidden_size, config, layer_number, num_layers,
                                 init_method_std, balancing_group=balancing_group,
                                 grad_average_size=grad_average_size)
        output_std = init_method_std / math.sqrt(2.0 * num_layers)
        if experts is not None:
            self.experts = SequentialExperts(list(experts))
        else:
            self.experts = GroupedExperts(
                config.num_experts, hidden_size, config.ffn_hidden_size, swiglu=swiglu,
                add_bias=add_bias_linear, init_method_std=init_method_std,
                output_init_std=output_std, grouped_gemm=grouped_gemm)
        # Grouped experts are linear after the activation, so the combine weights can scale
        # the [N, F] activation instead of the [N, H] output: with SwiGLU the fused op
        # (moe/swiglu.py) applies them for free and keeps only fc1's output, otherwise it
        # pays when F <= H (the multiply and the tensor autograd keeps are F wide, not H).
        self.probs_in_experts = (isinstance(self.experts, GroupedExperts)
                                 and (swiglu or config.ffn_hidden_size <= hidden_size))
        self.shared_experts = None
        if config.shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(
                hidden_size, config.shared_expert_intermediate_size, swiglu=swiglu,
                add_bias=add_bias_linear, gate=config.shared_expert_gate,
                init_method_std=init_method_std, output_init_std=output_std)
        # Set by apply_expert_parallel (moe/dispatcher.py) when experts span ranks; with
        # `tensor_parallel` the input is the TP-gathered sequence and the output this rank's
        # sequence shard (moe/expert_tensor_parallel.py).
        self.token_dispatcher = None
        self.tensor_parallel = None
        self.adaptive = None  # switchable ep / dp / tp execution (moe/adaptive.py)
        num_experts = config.num_experts
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.long),
                             persistent=False)
        # Routing statistics accumulated over training forwards until read (stats.py).
        self.register_buffer("stat_routed_per_expert",
                             torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("stat_kept_per_expert",
                             torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("stat_num_tokens", torch.zeros((), dtype=torch.long),
                             persistent=False)

    def _sequence_ids(self, shape: torch.Size) -> tuple[Optional[torch.Tensor], int]:
        """Token -> sequence index for seq_aux_loss, in the flattening order of `shape`."""
        if self.router.config.aux_loss_coeff("seq_aux_loss") <= 0 or len(shape) == 2:
            return None, 1
        if len(shape) != 3:
            raise ValueError(f"seq_aux_loss needs a [S, B, H] or [B, S, H] input, got "
                             f"{tuple(shape)}")
        num_tokens = shape[0] * shape[1]
        token_T = torch.arange(num_tokens, device=self.router.weight.device)
        if self.sequence_dim == 0:  # [S, B, H]: token s * B + b belongs to sequence b
            return token_T % shape[1], shape[1]
        return token_T // shape[1], shape[0]  # [B, S, H]

    def dispatch(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                 routing_map_TE: torch.Tensor, pad_capacity: Optional[int] = None
                 ) -> Dispatched:
        """Group token copies by expert. Grouped experts gather inside fc1 (the copies are
        then never stored), so here x_NH stays the token tensor (`gathered=False`)."""
        num_tokens = x_TH.shape[0]
        fuse = isinstance(self.experts, GroupedExperts)
        x_NH, token_indices_N, tokens_per_expert_E = permute(x_TH, routing_map_TE,
                                                             gather=not fuse)
        probs_N = permute_probs(probs_TE, routing_map_TE)
        if pad_capacity is None:
            return Dispatched(x_NH, probs_N, token_indices_N, tokens_per_expert_E, num_tokens,
                              False, not fuse)
        token_indices_P, probs_P = pad_groups(token_indices_N, probs_N, tokens_per_expert_E,
                                              pad_capacity, pad_index=num_tokens)
        x_ext_TH = torch.cat([x_TH, x_TH.new_zeros(1, x_TH.shape[1])])  # row T = padding
        sizes_E = torch.full_like(tokens_per_expert_E, pad_capacity)
        x_P = x_ext_TH if fuse else x_ext_TH.index_select(0, token_indices_P)
        return Dispatched(x_P, probs_P, token_indices_P, sizes_E, num_tokens, True, not fuse)

    def compute(self, d: Dispatched, params: Optional[dict[str, torch.Tensor]] = None
                ) -> torch.Tensor:
        """Expert outputs; grouped experts already weight them by the combine probs.
        `params` replaces the experts' parameters for this call (adaptive.py runs them
        with gathered or re-sliced weights)."""
        def experts(*args):
            if params is None:
                return self.experts(*args)
            return torch.func.functional_call(self.experts, params, args)

        if not d.gathered:
            probs_N = d.probs_N if self.probs_in_experts else None
            return experts(d.x_NH, d.tokens_per_expert_E, probs_N, d.token_indices_N)
        return experts(d.x_NH, d.tokens_per_expert_E)

    def combine(self, y_NH: torch.Tensor, d: Dispatched) -> torch.Tensor:
        probs_N = None if self.probs_in_experts else d.probs_N
        if d.padded:  # padding rows land in an extra row that is dropped
            return unpermute(y_NH, d.token_indices_N, probs_N, d.num_tokens + 1
                             )[: d.num_tokens]
        return unpermute(y_NH, d.token_indices_N, probs_N, d.num_tokens)

    def apply_capacity(self, probs_TE: torch.Tensor, routing_map_TE: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, Optional[int]]:
        """Drop assignments beyond capacity; returns the padding capacity (None = no pad)."""
        cfg = self.config
        cf = cfg.capacity_factor
        if cf is None or cfg.router_type != "topk":
            return probs_TE, routing_map_TE, None
        capacity = expert_capacity(routing_map_TE, cfg.topk, cf)
        probs_TE, routing_map_TE = apply_capacity(probs_TE, routing_map_TE, capacity,
                                                  cfg.token_drop_policy)
        pad = capacity if (cfg.pad_to_capacity or cf == 0) else None
        return probs_TE, routing_map_TE, pad

    def forward(self, hidden: torch.Tensor, parallel_mode: Optional[str] = None,
                adaptive_r: Optional[int] = None) -> torch.Tensor:
        """[..., H] -> [..., H] (typically [S, B, H]). With expert parallelism,
        `parallel_mode` ("ep" | "dp" | "tp") or Tutel's `adaptive_r` (0 | 1 | EP) picks how
        this call runs the experts (moe/adaptive.py); by default the layer's policy does."""
        if parallel_mode is not None or adaptive_r is not None:
            if self.adaptive is None:
                raise ValueError("parallel_mode / adaptive_r need an expert-parallel layer with "
                                 "adaptive parallelism enabled (enable_adaptive_parallelism)")
            if adaptive_r is not None:
                from megamoe.moe.adaptive import mode_from_adaptive_r

                parallel_mode = mode_from_adaptive_r(adaptive_r, self.adaptive.size)
        shape = hidden.shape
        x_TH = hidden.reshape(-1, self.hidden_size)
        seq_ids_T, num_seqs = (self._sequence_ids(shape) if self.training
                               else (None, 1))
        probs_TE, routing_map_TE, aux_loss = self.router.route(x_TH, seq_ids_T, num_seqs)
        routed_E = routing_map_TE.sum(dim=0)
        probs_TE, routing_map_TE, pad = self.apply_capacity(probs_TE, routing_map_TE)
        kept_E = routing_map_TE.sum(dim=0)
        self.tokens_per_expert = kept_E.detach()
        if self.training:
            self.stat_routed_per_expert += routed_E
            self.stat_kept_per_expert += kept_E
            self.stat_num_tokens += x_TH.shape[0]
        tp = self.tensor_parallel
        x_in, probs_in, map_in = ((x_TH, probs_TE, routing_map_TE) if tp is None
                                  else tp.enter(x_TH, probs_TE, routing_map_TE))
        if self.adaptive is not None:  # switchable parallelism (moe/adaptive.py)
            out_TH = self.adaptive.forward(self, x_in, probs_in, map_in, parallel_mode)
        elif self.token_dispatcher is not None:  # expert parallel (moe/dispatcher.py)
            out_TH = self.token_dispatcher.forward(x_in, probs_in, map_in, self.experts)
        else:
            d = self.dispatch(x_in, probs_in, map_in, pad)
            out_TH = self.combine(self.compute(d), d)
        if tp is not None:  # -> this rank's sequence shard
            out_TH = tp.exit(out_TH)
            shape = (shape[0] // tp.tp_size, *shape[1:])
        if self.shared_experts is not None:
            shared_TH = self.shared_experts(x_TH).to(out_TH.dtype)
            out_TH = out_TH + (shared_TH if tp is None else tp.shard(shared_TH))
        if aux_loss is not None:
            out_TH = attach_aux_loss(out_TH, aux_loss)
        return out_TH.reshape(shape)
