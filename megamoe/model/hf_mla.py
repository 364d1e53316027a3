"""Hugging Face DeepSeek-V2/V3 attention (`DeepseekV3Attention`) <-> megamoe's
MLASelfAttention names, one layer at a time (for the DeepSeek-V3 converter).

The tensors are equal (both head-major, DeepSeek's rope_interleave pair order, see
model/mla.py), so the mapping only renames. It pops what it maps from `src`, so a caller
can check that every key of a checkpoint was consumed.

The model must have been configured to match: q_proj exists iff --q-lora-rank is None;
q_a_layernorm / kv_a_layernorm need --qk-layernorm (Megatron builds MLA's latent norms
with it only, DeepSeek always has them); attention biases (HF attention_bias, on q_a_proj,
kv_a_proj_with_mqa and o_proj) are not supported: MLA's projections have none in
Megatron, except linear_proj's with --add-bias-linear, which maps to o_proj.bias.
YaRN: HF's rope_parameters factor / mscale / mscale_all_dim / original_max_position_
embeddings / beta_fast / beta_slow are ModelConfig's rotary_scaling_factor / mscale /
mscale_all_dim / original_max_position_embeddings / beta_fast / beta_slow. (HF takes
attention_factor = mscale(factor) when mscale or mscale_all_dim is 0, Megatron and
megamoe mscale(factor, mscale) / mscale(factor, mscale_all_dim): equal for DeepSeek-V3's
mscale = mscale_all_dim = 1.)
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# (HF name under the attention module, megamoe name under self_attention)
MLA_HF_NAMES = (
    ("q_proj.weight", "linear_q_proj.weight"),
    ("q_a_proj.weight", "linear_q_down_proj.weight"),
    ("q_a_layernorm.weight", "q_layernorm.weight"),
    ("q_b_proj.weight", "linear_q_up_proj.weight"),
    ("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"),
    ("kv_a_layernorm.weight", "kv_layernorm.weight"),
    ("kv_b_proj.weight", "linear_kv_up_proj.weight"),
    ("o_proj.weight", "linear_proj.weight"),
    ("o_proj.bias", "linear_proj.bias"),
)


def mla_from_hf(src: dict[str, Tensor], hf_prefix: str, mm_prefix: str) -> dict[str, Tensor]:
    """Pop one layer's HF attention tensors (`{hf_prefix}.q_a_proj.weight`, ...; e.g.
    hf_prefix "model.layers.3.self_attn") from `src`; return them under megamoe's names
    (`{mm_prefix}.linear_q_down_proj.weight`, ...; e.g. "decoder.layers.3.self_attention").
    Names absent from `src` are skipped (which exist depends on the configuration)."""
    out = {}
    for hf, mm in MLA_HF_NAMES:
        key = f"{hf_prefix}.{hf}"
        if key in src:
            out[f"{mm_prefix}.{mm}"] = src.pop(key)
    return out


def mla_to_hf(src: dict[str, Tensor], mm_prefix: str, hf_prefix: str) -> dict[str, Tensor]:
    """The inverse of `mla_from_hf`: pop megamoe's tensors of one layer from `src`."""
    out = {}
    for hf, mm in MLA_HF_NAMES:
        key = f"{mm_prefix}.{mm}"
        if key in src:
            out[f"{hf_prefix}.{hf}"] = src.pop(key)
    return out
