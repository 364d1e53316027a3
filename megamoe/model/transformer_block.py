"""Pre-norm transformer layers and the decoder stack.

layer(x) = x + drop(attn(norm1(x))), then x + drop(mlp(norm2(x))); the MLP is an MoE layer
where `config.is_moe_layer(i)`. The block ends with the final norm.

Built as the single-process model; the parallelize step (megamoe/parallelize.py) sets
`tp` and shards the layers inside. With sequence parallelism the residual stream, norms
and dropout live on [S/TP, B, H] shards; the dense MLP and attention gather and
reduce-scatter inside their column/row-parallel linears, and the MoE layer's dispatcher
gathers the whole sequence (routing equals single-process) and returns this rank's shard,
so both MLP kinds take and return the residual stream's layout.

Activation recompute (set by the parallelize step from --recompute-*): `recompute_groups`
of a block (or pipeline stage) are the layer groups checkpointed whole (full granularity);
a layer's `recompute_mlp` checkpoints its dense MLP or MoE layer together with the
pre-MLP norm (the region keeps the residual, which the norm keeps anyway, instead of the
norm's output), and `recompute_norms` discards the norms' outputs (layernorm).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.attention import DocumentMask, SelfAttention
from megamoe.model.mla import MLASelfAttention
from megamoe.model.mlp import MLP
from megamoe.model.norms import build_norm
from megamoe.moe.layer import MoELayer
from megamoe.parallel.checkpointing import checkpoint, maybe_checkpoint, maybe_discard
from megamoe.parallel.tensor_parallel import SINGLE, TensorParallel


def build_mlp(config: ModelConfig, layer_index: int) -> nn.Module:
    """Dense MLP or MoE layer for layer `layer_index` (0-based, as the MoE loss tracker;
    num_layers + k for MTP depth k)."""
    if not config.is_moe_layer(layer_index):
        return MLP(config)
    layer = MoELayer(config.moe, config.hidden_size, layer_number=layer_index,
                     num_layers=config.num_layers, init_method_std=config.init_method_std,
                     add_bias_linear=config.add_bias_linear, swiglu=config.swiglu,
                     activation=config.activation)
    # MTP layers (model/mtp.py) log their MoE losses after the decoder's, as Megatron.
    layer.router.num_layers = config.num_layers + config.num_mtp_layers
    return layer


class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.tp: TensorParallel = SINGLE
        self.input_layernorm = build_norm(config, config.hidden_size)
        self.self_attention = (MLASelfAttention(config) if config.multi_latent_attention
                               else SelfAttention(config))
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size)
        self.is_moe = config.is_moe_layer(layer_index)
        self.mlp = build_mlp(config, layer_index)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.recompute_mlp = False
        self.recompute_norms = False
        # Transformer Engine (model/te/apply.py sets these): the norm runs fused inside
        # the next linear (LayerNormLinear), and the layer's forward runs inside TE's
        # autocast (a function giving the context: FP8 under the --fp8-* recipe)
        self.fused_input_norm = self.fused_pre_mlp_norm = False
        self.quantization: Optional[Callable[[], ContextManager]] = None

    def _dropout(self, x_SBH: torch.Tensor) -> torch.Tensor:
        with self.tp.dropout_rng(split=self.tp.sp):  # SP shards: per-rank masks
            return self.dropout(x_SBH)

    def forward(self, x_SBH: torch.Tensor,
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                docs: Optional[DocumentMask] = None) -> torch.Tensor:
        with self.quantization() if self.quantization is not None else nullcontext():
            x_SBH = x_SBH + self._dropout(self._attention(x_SBH, rotary, docs))
            return x_SBH + self._dropout(maybe_checkpoint(self.recompute_mlp, self._mlp,
                                                          x_SBH))

    def _attention(self, x_SBH: torch.Tensor,
                   rotary: Optional[tuple[torch.Tensor, torch.Tensor]],
                   docs: Optional[DocumentMask] = None) -> torch.Tensor:
        if self.fused_input_norm:  # linear_qkv normalises (TE's LayerNormLinear)
            return self.self_attention(x_SBH, rotary, docs)
        y_SBH = self.input_layernorm(x_SBH)
        with maybe_discard(self.recompute_norms, y_SBH, lambda: self.input_layernorm(x_SBH)):
            return self.self_attention(y_SBH, rotary, docs)

    def _mlp(self, x_SBH: torch.Tensor) -> torch.Tensor:
        if self.fused_pre_mlp_norm:  # the dense MLP's linear_fc1 normalises (TE)
            return self.mlp(x_SBH)
        y_SBH = self.pre_mlp_layernorm(x_SBH)
        with maybe_discard(self.recompute_norms, y_SBH, lambda: self.pre_mlp_layernorm(x_SBH)):
            return self.mlp(y_SBH)


def _run_group(layers: Sequence[TransformerLayer], x_SBH: torch.Tensor,
               rotary: Optional[tuple[torch.Tensor, torch.Tensor]],
               docs: Optional[DocumentMask] = None) -> torch.Tensor:
    for layer in layers:
        x_SBH = layer(x_SBH, rotary, docs)
    return x_SBH


def run_layers(layers: Sequence[TransformerLayer], x_SBH: torch.Tensor,
               rotary: Optional[tuple[torch.Tensor, torch.Tensor]],
               recompute_groups: Sequence[Sequence[int]] = (),
               docs: Optional[DocumentMask] = None) -> torch.Tensor:
    """The layers in order; each group of `recompute_groups` (local indices, consecutive)
    runs as one checkpointed region that keeps only its input."""
    first = {group[0]: group for group in recompute_groups}
    i = 0
    while i < len(layers):
        group = first.get(i, ())
        if not group:
            x_SBH = layers[i](x_SBH, rotary, docs)
            i += 1
            continue
        x_SBH = checkpoint(functools.partial(_run_group, [layers[j] for j in group]),
                           x_SBH, rotary, docs)
        i += len(group)
    return x_SBH


class TransformerBlock(nn.Module):
    """`num_layers` layers then the final norm; [S, B, H] in and out ([S/TP, B, H] with SP)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config, i)
                                    for i in range(config.num_layers))
        self.final_layernorm = build_norm(config, config.hidden_size)
        self.recompute_groups: list[list[int]] = []  # full recompute (parallelize sets it)

    def forward(self, x_SBH: torch.Tensor,
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                docs: Optional[DocumentMask] = None) -> torch.Tensor:
        x_SBH = run_layers(self.layers, x_SBH, rotary, self.recompute_groups, docs)
        return self.final_layernorm(x_SBH)
