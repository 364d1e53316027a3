"""Multi-latent attention on Transformer Engine's modules: Megatron's MLA TE spec.

megatron-core's `get_gpt_layer_with_transformer_engine_submodules(multi_latent_attention=
True)` (gpt_layer_specs.py; its default, without --mla-down-proj-fusion) with the q/kv
norm placement of mla_qk_norm_config.py's QKNormConfigResolver:

  input_layernorm                      -> a norm of its own (TENorm: not fused; megamoe's
                                          norm stays, as for the other unfused norms)
  linear_q_proj (no --q-lora-rank)     -> Linear (TEColumnParallelLinear)
  linear_q_down_proj, linear_kv_down_proj -> Linear (TELinear, parallel_mode duplicated)
  q_layernorm + linear_q_up_proj       -> LayerNormLinear with --qk-layernorm (the norm
  kv_layernorm + linear_kv_up_proj        fused: TELayerNormColumnParallelLinear), else Linear
  core attention                       -> DotProductAttention, kv_channels=(q head dim,
                                          v head dim), MLA's softmax scale (under CP
                                          megamoe's CP attention, none built: te/apply.py)
  linear_proj                          -> Linear (TERowParallelLinear; megamoe adds the bias)

Each module computes with MLASelfAttention's own parameters (engine.py), so the names and
checkpoints are the local path's; with the norms fused MLASelfAttention skips its own
(`fused_latent_norms`), as TransformerLayer skips a fused input norm.

Under TP (te/apply.py) the modules run the local GEMMs inside MLASelfAttention's own TP
layers: the replicated down projections on the whole input, the column-parallel up
projections on this rank's heads. A fused latent norm then runs inside the up
projection's column-parallel region and its gradient is partial over TP: summed over TP
as the fused input norm's (linears.py `TeNormLinearGemm`); the latents' input gradient
is still summed by the up projections' TP entry, so the down projections' gradients stay
whole, as on the local path.

--qk-layernorm without --q-lora-rank: megatron-core since Megatron-LM 4464d1c (in 0.19.2)
fuses a norm of the hidden states into linear_q_proj; megamoe's MLA has no such norm
(megatron_mla.py; the local path is the same model), so linear_q_proj stays a plain Linear
and only the kv latent's norm is fused: the TE path builds the local path's model, a
deliberate difference from that megatron-core (docs/transformer-engine.md).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from megamoe.model.mla import MLASelfAttention
from megamoe.model.te.attention import TeCoreAttention
from megamoe.model.te.extra_state import TeExtraState
from megamoe.model.te.linears import TeLinearGemm, TeNormLinearGemm
from megamoe.model.te.loader import TransformerEngine


def _up_proj(te: TransformerEngine, linear: nn.Module, norm: Optional[nn.Module]):
    """An up projection's engine: its latent norm fused in front when there is one."""
    if norm is None:
        return TeLinearGemm(te, linear, bias=False)
    return TeNormLinearGemm(te, norm, linear)


def convert_mla(te: TransformerEngine, prefix: str, attn: MLASelfAttention,
                layer_number: int, state: TeExtraState) -> None:
    """Install TE's modules on `attn` (in place); `prefix`: its module name, under which
    each TE module's extra state is kept (Megatron's TE-spec names)."""
    engines = {}
    if attn.linear_q_proj is not None:
        engines["linear_q_proj"] = TeLinearGemm(te, attn.linear_q_proj, bias=False)
    else:
        engines["linear_q_down_proj"] = TeLinearGemm(te, attn.linear_q_down_proj, bias=False)
        engines["linear_q_up_proj"] = _up_proj(te, attn.linear_q_up_proj, attn.q_layernorm)
    engines["linear_kv_down_proj"] = TeLinearGemm(te, attn.linear_kv_down_proj, bias=False)
    engines["linear_kv_up_proj"] = _up_proj(te, attn.linear_kv_up_proj, attn.kv_layernorm)
    engines["linear_proj"] = TeLinearGemm(te, attn.linear_proj, bias=False)
    for sub, engine in engines.items():
        getattr(attn, sub).fp8 = engine
        state.add(f"{prefix}.{sub}", engine.module)
    attn.fused_latent_norms = True
    if attn.cp_group is not None:  # megamoe's CP core attention runs (te/apply.py)
        return
    heads = attn.linear_kv_up_proj.weight.shape[0] // (attn.qk_head_dim + attn.v_head_dim)
    attn.te_core_attention = TeCoreAttention(
        te, attn, num_heads=heads, num_groups=heads, head_dim=attn.q_head_dim,
        v_head_dim=attn.v_head_dim, softmax_scale=attn.softmax_scale,
        layer_number=layer_number)
    state.add(f"{prefix}.core_attention", attn.te_core_attention.module)
