"""--transformer-impl transformer_engine: install TE's modules on a built model.

The model is built, parallelized and materialised as for `local`; this step then gives
each transformer layer TE's implementation of its parts, Megatron's TE spec
(megatron/core/models/gpt/gpt_layer_specs.py):

  input_layernorm + self_attention.linear_qkv -> LayerNormLinear (norm fused)
  self_attention.core_attention               -> DotProductAttention
  self_attention.linear_proj                  -> Linear
  multi-latent attention (MLA's own TE spec)  -> te/mla.py
  dense MLP: pre_mlp_layernorm + linear_fc1   -> LayerNormLinear (norm fused); linear_fc2 -> Linear
  MoE: routed experts' fc1 / fc2              -> GroupedLinear each (TEGroupedMLP)
       shared experts' linear_fc1 / fc2       -> Linear
  MTP: eh_proj                                -> Linear

each computing with the layer's own parameters (engine.py), and each layer's forward
inside TE's autocast with the recipe of the --fp8-* flags (recipe.py). The router, the
norms not fused (MoE layers' pre_mlp_layernorm, the final norm, q/k norms), embeddings
and the output layer stay megamoe's, as do every collective and the MoE dispatch; with
--fp8-output-proj the output layer's GEMM runs on TE's Linear under the autocast
(output.py, Megatron's TELMHeadColumnParallelLinear).

Tensor (+ sequence) parallelism: each TE module runs this rank's *local* GEMM (TE's
parallel_mode None, local shapes: the layers' sharded parameters), and megamoe's
Column/RowParallelLinear keep running the collectives around the hook, as for `local`.
The fused norm of a LayerNormLinear then sits inside the column-parallel region (after
the input's all-gather under SP, after the identity-forward / all-reduce-backward copy
without SP): its weight's gradient on each TP rank is the part from that rank's output
columns only, and is summed over TP (linears.py `TeNormLinearGemm`). Megatron's TE
LayerNormLinear (parallel_mode "column") all-reduces the input gradient before the norm's
backward instead; the norm's gradient is linear in that input gradient, so the sums are
the same (MLA's fused latent norms likewise, te/mla.py). Core attention gets the local
head counts; the routed experts' GroupedLinear the local (expert-tensor-parallel) shards.

Context parallelism: the core attention stays megamoe's (parallel/context_parallel.py:
ring or all-to-all, --cp-comm-type) and no DotProductAttention is built (for MLA neither,
te/mla.py); TE runs the linears. Megatron runs TE's own CP attention (cp_group /
cp_comm_type): the same algorithm, not the same kernels.

Not built yet (refused by `check_run` before anything is built, and here for library
callers): --tp-comm-overlap (its collective matmul bypasses the GEMM hook: TE's
userbuffers are not wired), document masks (--reset-attention-mask), --compile,
--recompute-modules layernorm (the norms are fused into the linears), and activation
recompute under delayed FP8 scaling (a torch checkpoint's replay would update TE's amax
state a second time; TE's own checkpoint is not wired).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import torch.distributed as dist
from torch import nn

from megamoe.config.fp8 import Fp8Config
from megamoe.model.fp8.policy import (
    fp8_gemm_modules,
    high_precision_layer,
    output_heads,
    set_router_padding,
)
from megamoe.model.mla import MLASelfAttention
from megamoe.model.mlp import MLP
from megamoe.model.mtp import MTPLayer
from megamoe.model.te.attention import TeCoreAttention, set_backend_environment
from megamoe.model.te.experts import TeGroupedGemm
from megamoe.model.te.extra_state import TeExtraState
from megamoe.model.te.linears import TeLinearGemm, TeNormLinearGemm
from megamoe.model.te.loader import TransformerEngine, load_transformer_engine
from megamoe.model.te.mla import convert_mla
from megamoe.model.te.output import TeOutputGemm
from megamoe.model.te.recipe import autocast_factory
from megamoe.model.transformer_block import TransformerLayer
from megamoe.moe.experts import GroupedExperts
from megamoe.moe.layer import MoELayer

TE_ENGINES = (TeLinearGemm, TeNormLinearGemm, TeGroupedGemm)
Autocast = Callable[[], ContextManager]


def _refuse(what: str) -> ValueError:
    return ValueError(f"not supported yet: {what} with --transformer-impl transformer_engine")


def _check_model(model: nn.Module) -> None:
    """What the engines cannot take over (the run's checks name the flags first)."""
    for m in model.modules():
        tp = getattr(m, "tp", None)
        if tp is not None and tp.comm_overlap is not None:
            raise _refuse("--tp-comm-overlap")
        if isinstance(m, TransformerLayer):
            if m.recompute_norms:
                raise _refuse("--recompute-modules layernorm")
        if isinstance(m, MoELayer) and not isinstance(m.experts, GroupedExperts):
            raise _refuse("custom expert modules")
        if getattr(m, "fp8", None) is not None or getattr(m, "output_fp8", None) is not None:
            raise ValueError("the model's GEMMs already have an implementation (megamoe's "
                             "FP8 policy or Transformer Engine): install one, once")


def _convert_attention(te: TransformerEngine, name: str, layer: TransformerLayer,
                       state: TeExtraState) -> None:
    attn = layer.self_attention
    attn.linear_qkv.fp8 = TeNormLinearGemm(te, layer.input_layernorm, attn.linear_qkv)
    layer.fused_input_norm = True
    attn.linear_proj.fp8 = TeLinearGemm(te, attn.linear_proj, bias=False)
    prefix = f"{name}.self_attention"
    state.add(f"{prefix}.linear_qkv", attn.linear_qkv.fp8.module)
    if attn.cp_group is None:  # (under CP megamoe's CP core attention runs: docstring)
        heads = attn.linear_qkv.local_blocks[0] // attn.head_dim  # this TP rank's heads
        groups = attn.linear_qkv.local_blocks[1] // attn.head_dim
        attn.te_core_attention = TeCoreAttention(te, attn, num_heads=heads,
                                                 num_groups=groups, head_dim=attn.head_dim,
                                                 layer_number=layer.layer_index + 1)
        state.add(f"{prefix}.core_attention", attn.te_core_attention.module)
    state.add(f"{prefix}.linear_proj", attn.linear_proj.fp8.module)


def _convert_layer(te: TransformerEngine, name: str, layer: TransformerLayer,
                   autocast: Autocast, state: TeExtraState) -> None:
    attn = layer.self_attention
    if isinstance(attn, MLASelfAttention):  # its input norm stays apart (te/mla.py)
        convert_mla(te, f"{name}.self_attention", attn, layer.layer_index + 1, state)
    else:
        _convert_attention(te, name, layer, state)
    mlp = layer.mlp
    if isinstance(mlp, MLP):
        mlp.linear_fc1.fp8 = TeNormLinearGemm(te, layer.pre_mlp_layernorm, mlp.linear_fc1)
        layer.fused_pre_mlp_norm = True
        mlp.linear_fc2.fp8 = TeLinearGemm(te, mlp.linear_fc2, bias=False)
        for sub in ("linear_fc1", "linear_fc2"):
            state.add(f"{name}.mlp.{sub}", getattr(mlp, sub).fp8.module)
    elif isinstance(mlp, MoELayer):
        mlp.experts.fp8 = TeGroupedGemm(te, mlp.experts)
        for sub, module in mlp.experts.fp8.modules().items():
            state.add(f"{name}.mlp.experts.{sub}", module)
        shared = mlp.shared_experts
        if shared is not None:
            shared.linear_fc1.fp8 = TeLinearGemm(te, shared.linear_fc1,
                                                 bias=shared.linear_fc1.bias is not None)
            shared.linear_fc2.fp8 = TeLinearGemm(te, shared.linear_fc2, bias=False)
            for sub in ("linear_fc1", "linear_fc2"):
                state.add(f"{name}.mlp.shared_experts.{sub}", getattr(shared, sub).fp8.module)
    layer.quantization = autocast


def apply_transformer_engine(model: nn.Module, fp8: Fp8Config,
                             amax_group: Optional[dist.ProcessGroup] = None, *,
                             attention_backend: str = "auto", use_flash_attn: bool = False,
                             te: Optional[TransformerEngine] = None,
                             num_layers: int = 0) -> TeExtraState:
    """Install TE's modules on every transformer layer and MTP layer of `model` (in
    place); `model.te_state` (returned) holds their checkpoint extra state. `amax_group`:
    delayed scaling's amax reduction group. TransformerEngineMissing (loader.py) when TE
    cannot be imported."""
    if fp8.enabled and fp8.first_last_layers_bf16 and num_layers <= 0:
        raise ValueError("--first-last-layers-bf16 needs the decoder's num_layers")
    te = te or load_transformer_engine()
    set_router_padding(model, fp8)
    _check_model(model)
    set_backend_environment(attention_backend, use_flash_attn)
    autocast = autocast_factory(te, fp8, amax_group)
    state = TeExtraState()
    for name, m in model.named_modules():
        if isinstance(m, TransformerLayer):
            # --first-last-layers-bf16: TE's modules without the FP8 autocast (Megatron's
            # get_fp8_context gives those layers a null context)
            high = fp8.enabled and high_precision_layer(fp8, m.layer_index, num_layers)
            _convert_layer(te, name, m, contextlib.nullcontext if high else autocast, state)
        elif isinstance(m, MTPLayer):
            m.eh_proj.fp8 = TeLinearGemm(te, m.eh_proj, bias=False,
                                         autocast=autocast if fp8.enabled else None)
            state.add(f"{name}.eh_proj", m.eh_proj.fp8.module)
    if fp8.enabled and fp8.output_proj:  # MXFP8 (config/fp8.py): no extra state to save
        for _, head in output_heads(model):
            head.output_fp8 = TeOutputGemm(te, head, head.output_weight(), autocast)
    for name, m in fp8_gemm_modules(model):  # every GEMM FP8 would cover, TE covers
        if not isinstance(getattr(m, "fp8", None), TE_ENGINES):
            raise _refuse(f"the GEMM {name}")
    model.te_state = state
    return state
