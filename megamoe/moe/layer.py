"""MoELayer: route -> capacity -> dispatch -> experts -> combine (+ shared experts, aux loss).

The layer holds exactly one token dispatcher (moe/dispatchers/): a local one as built,
replaced by the parallelize step with the expert-parallel, tensor-parallel or adaptive one
the layout needs. The forward has one path whatever the layout; how tokens reach the
experts is the dispatcher's business. The layer also works standalone (Tutel's
`moe_layer`, FastMoE's `FMoE`): any [..., H] input, built from keyword arguments, with
stacked grouped experts or any list of modules.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from megamoe.config import MoEConfig
from megamoe.moe.capacity import apply_capacity, expert_capacity
from megamoe.moe.dispatchers import LocalDispatcher, TokenDispatcher
from megamoe.moe.experts import GroupedExperts, SequentialExperts, SharedExpertMLP
from megamoe.moe.losses import attach_aux_loss
from megamoe.moe.quantization_padding import pad_routing_map
from megamoe.moe.router import TopKRouter
from megamoe.moe.shared_overlap import SharedExpertOverlap
from megamoe.parallel.checkpointing import is_recomputing, maybe_checkpoint


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
                 activation: Optional[str] = None,
                 experts: Optional[Sequence[nn.Module]] = None, sequence_dim: int = 0,
                 balancing_group: Optional[dist.ProcessGroup] = None,
                 grad_average_size: int = 1, grouped_gemm: bool = False,
                 **config_kwargs) -> None:
        super().__init__()
        config = _config(config, hidden_size, experts, sequence_dim, config_kwargs)
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
                output_init_std=output_std, grouped_gemm=grouped_gemm, activation=activation)
        self.shared_experts = None
        if config.shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(
                hidden_size, config.shared_expert_intermediate_size, swiglu=swiglu,
                add_bias=add_bias_linear, gate=config.shared_expert_gate,
                init_method_std=init_method_std, output_init_std=output_std,
                activation=activation)
        self.dispatcher: TokenDispatcher = LocalDispatcher.for_experts(self.experts)
        self.recompute_shared = False  # --recompute-modules shared_experts (parallelize)
        # --moe-shared-expert-overlap (parallelize; moe/shared_overlap.py): the shared
        # expert runs inside the dispatcher, while its exchanges are in flight.
        self.shared_expert_overlap = False
        # --moe-router-padding-for-quantization (the FP8 policy sets it; 0: off): each
        # expert's token count padded to a multiple of it (moe/quantization_padding.py)
        self.quantization_alignment = 0
        self._register_statistics(config.num_experts)

    def _register_statistics(self, num_experts: int) -> None:
        """Kept assignments of the last call, and routing statistics accumulated over the
        training forwards until read (stats.py)."""
        device = self.router.weight.device  # the device the model is built on
        for name in ("tokens_per_expert", "stat_routed_per_expert", "stat_kept_per_expert"):
            self.register_buffer(name, torch.zeros(num_experts, dtype=torch.long,
                                                   device=device), persistent=False)
        self.register_buffer("stat_num_tokens", torch.zeros((), dtype=torch.long,
                                                            device=device), persistent=False)

    def _sequence_ids(self, shape: torch.Size) -> tuple[Optional[torch.Tensor], int]:
        """Token -> sequence index for seq_aux_loss, in the flattening order of `shape`."""
        if (not self.training or self.router.config.aux_loss_coeff("seq_aux_loss") <= 0
                or len(shape) == 2):
            return None, 1
        if len(shape) != 3:
            raise ValueError(f"seq_aux_loss needs a [S, B, H] or [B, S, H] input, got "
                             f"{tuple(shape)}")
        num_tokens = shape[0] * shape[1]
        token_T = torch.arange(num_tokens, device=self.router.weight.device)
        if self.sequence_dim == 0:  # [S, B, H]: token s * B + b belongs to sequence b
            return token_T % shape[1], shape[1]
        return token_T // shape[1], shape[0]  # [B, S, H]

    def apply_capacity(self, probs_TE: torch.Tensor, routing_map_TE: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, Optional[int]]:
        """Drop assignments beyond capacity; returns the padding capacity (None = no pad).

        Under TP + SP the routed tokens are the gathered sequence, and capacity is counted
        in each TP rank's shard of it (Megatron: each rank routes, and drops, its shard),
        or over the whole of it with --moe-capacity-over-tp-gathered-sequence."""
        cfg = self.config
        cf = cfg.capacity_factor
        if cf is None or cfg.router_type != "topk":
            return probs_TE, routing_map_TE, None
        shards = self.dispatcher.capacity_shards()
        capacity = expert_capacity(routing_map_TE, cfg.topk, cf, shards)
        probs_TE, routing_map_TE = apply_capacity(probs_TE, routing_map_TE, capacity,
                                                  cfg.token_drop_policy, shards)
        pad = capacity if (cfg.pad_to_capacity or cf == 0) else None
        return probs_TE, routing_map_TE, pad

    def _count(self, routed_E: torch.Tensor, kept_E: torch.Tensor, num_tokens: int) -> None:
        """Statistics of the real forwards (a recompute replay counts nothing)."""
        self.tokens_per_expert = kept_E.detach()
        if self.training and not is_recomputing():
            self.stat_routed_per_expert += routed_E
            self.stat_kept_per_expert += kept_E
            self.stat_num_tokens += num_tokens

    def forward(self, hidden: torch.Tensor, parallel_mode: Optional[str] = None,
                adaptive_r: Optional[int] = None) -> torch.Tensor:
        """[..., H] -> [..., H] of the same shape (typically [S, B, H]; under sequence
        parallelism this rank's [S/TP, B, H] shard). With adaptive parallelism,
        `parallel_mode` ("ep" | "dp" | "tp") or Tutel's `adaptive_r` (0 | 1 | EP) picks how
        this call runs the experts; by default the layer's measured choice does."""
        mode = self.dispatcher.mode_for(parallel_mode, adaptive_r)
        full = self.dispatcher.gather_sequence(hidden)  # the tokens this rank routes
        x_TH = full.reshape(-1, self.hidden_size)
        probs_TE, routing_map_TE, aux_loss = self.router.route(
            x_TH, *self._sequence_ids(full.shape), count_expert_bias=False)
        routed_E = routing_map_TE.sum(dim=0)
        probs_TE, routing_map_TE, pad = self.apply_capacity(probs_TE, routing_map_TE)
        kept_E = routing_map_TE.sum(dim=0)
        self._count(routed_E, kept_E, x_TH.shape[0])
        # Expert bias: Megatron counts the kept assignments (after the drops).
        before = self.config.expert_bias_counts_before_capacity
        self.router.count_for_expert_bias(routed_E if before else kept_E)
        if self.quantization_alignment:  # --moe-router-padding-for-quantization
            routing_map_TE = pad_routing_map(routing_map_TE, self.quantization_alignment)
        mine_TH = x_TH if full is hidden else hidden.reshape(-1, self.hidden_size)
        if self.shared_expert_overlap and self.shared_experts is not None:
            shared = SharedExpertOverlap(self.shared_experts, mine_TH)
            out_TH = self.dispatcher(x_TH, probs_TE, routing_map_TE, self.experts, pad, mode,
                                     shared=shared)
            out_TH = out_TH + shared.output().to(out_TH.dtype)
        else:
            out_TH = self.dispatcher(x_TH, probs_TE, routing_map_TE, self.experts, pad, mode)
            if self.shared_experts is not None:  # on the layer's input: under SP its shard
                shared_TH = maybe_checkpoint(self.recompute_shared, self.shared_experts,
                                             mine_TH)
                out_TH = out_TH + shared_TH.to(out_TH.dtype)
        if aux_loss is not None:
            out_TH = attach_aux_loss(out_TH, aux_loss)
        return out_TH.reshape(hidden.shape)


def _config(config: Optional[MoEConfig], hidden_size: Optional[int],
            experts: Optional[Sequence[nn.Module]], sequence_dim: int,
            config_kwargs: dict) -> MoEConfig:
    """The layer's MoEConfig from either a config or keyword options (checked)."""
    if hidden_size is None:
        raise ValueError("MoELayer needs hidden_size")
    if config is None:
        if experts is not None:
            config_kwargs.setdefault("num_experts", len(experts))
        unknown = set(config_kwargs) - {f.name for f in dataclasses.fields(MoEConfig)}
        if unknown:
            raise TypeError(f"MoELayer got unknown options {sorted(unknown)}")
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
    return config
