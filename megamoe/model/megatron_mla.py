"""megatron-core's multi-latent attention tensors <-> MLASelfAttention's (model/mla.py), and
the MTP depths' own tensors (model/mtp.py), for megatron_mapping.py.

What megatron-core 0.19 builds and saves (multi_latent_attention.py, gpt_layer_specs.py,
multi_token_prediction.py; verified on real saves in tests/tools/megatron_peer):

- the projections carry megamoe's names: `self_attention.linear_q_down_proj`,
  `linear_q_up_proj` (or `linear_q_proj` without --q-lora-rank), `linear_kv_down_proj`,
  `linear_kv_up_proj`, `linear_proj`, in the same layouts: linear_kv_down_proj's output
  rows are the kv latent then the shared rope part ([kv_lora_rank | qk_pos_emb_head_dim],
  split so in get_query_key_value_tensors), linear_kv_up_proj's rows head-major with each
  head's k_nope then v ([n, qk_head_dim + v_head_dim], split so), the query's rows
  head-major with each head's qk_head_dim then its rope part. So the weights copy as they
  are; the rope part is rotated in the MLA pair order on both sides
  (apply_rotary_pos_emb(..., mla_rotary_interleaved=True), rope.py
  apply_rotary_interleaved).
- the latent norms (--qk-layernorm): the local spec's `q_layernorm.weight` /
  `kv_layernorm.weight`; the TE spec fuses them into the up projections,
  `linear_q_up_proj.layer_norm_weight` / `linear_kv_up_proj.layer_norm_weight`.
  With --qk-layernorm and no --q-lora-rank (DeepSeek-V2-Lite), megatron-core since
  Megatron-LM 4464d1c (July 2026; in 0.19.2, mla_qk_norm_config.py) fuses a norm of
  the hidden states into the TE spec's linear_q_proj
  (`linear_q_proj.layer_norm_weight`; its local spec refuses to build), which
  MLASelfAttention does not have: such a checkpoint is refused; one written before
  (plain linear_q_proj, kv_layernorm only) converts.
- the input norm is `input_layernorm.weight` in both specs (MLA's spec keeps it apart from
  the projections); the pre-MLP norm `pre_mlp_layernorm.weight`, except in the TE spec's
  dense layers (`mlp.linear_fc1.layer_norm_weight`).
- MTP depth k: `mtp.layers.{k}.enorm.weight`, `hnorm.weight`, `eh_proj.weight` ([H, 2H]:
  the embedding's half first, as both concatenate), `final_layernorm.weight`, and a
  transformer layer under `mtp.layers.{k}.transformer_layer.` (megatron-core's module is
  `mtp_model_layer`, saved under the old name); one key per depth, never stacked.
"""

from __future__ import annotations

import torch

from megamoe.config import ModelConfig

Tensor = torch.Tensor

MLA_NAMES = ("linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
             "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "linear_proj.weight",
             "linear_proj.bias", "q_layernorm.weight", "kv_layernorm.weight")
# The TE spec's names of the latent norms (fused into the up projections).
TE_NORMS = {"q_layernorm.weight": "linear_q_up_proj.layer_norm_weight",
            "kv_layernorm.weight": "linear_kv_up_proj.layer_norm_weight"}
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")


def mla_to_megamoe(src: dict[str, Tensor], att: str, mm: str) -> dict[str, Tensor]:
    """Pop one layer's MLA tensors under Megatron's `att` prefix (either spec's names)
    from `src`; return them under megamoe's `mm` prefix."""
    if f"{att}.linear_q_proj.layer_norm_weight" in src:
        raise ValueError(f"{att}.linear_q_proj.layer_norm_weight: megatron-core's norm of "
                         "the hidden states inside linear_q_proj (--qk-layernorm without "
                         "--q-lora-rank) is not supported yet by megamoe's MLA")
    out = {}
    for name in MLA_NAMES:
        found = [n for n in (name, TE_NORMS.get(name)) if n and f"{att}.{n}" in src]
        if len(found) > 1:
            raise KeyError(f"{att}: both {found[0]} and {found[1]} (one norm, two names)")
        if found:
            out[f"{mm}.{name}"] = src.pop(f"{att}.{found[0]}")
    return out


def mla_to_megatron(src: dict[str, Tensor], mm: str, spec: str) -> dict[str, Tensor]:
    """Pop one layer's MLA tensors under megamoe's `mm` prefix; return them named as the
    `spec` ("te" or "local") model names them, relative to the layer."""
    out = {}
    for name in MLA_NAMES:
        if f"{mm}.{name}" in src:
            mg = TE_NORMS.get(name, name) if spec == "te" else name
            out[f"self_attention.{mg}"] = src.pop(f"{mm}.{name}")
    return out


def mla_extra_state_modules(config: ModelConfig) -> list[str]:
    """The attention modules of an MLA layer that save an `_extra_state` item."""
    q = (["linear_q_proj"] if config.q_lora_rank is None
         else ["linear_q_down_proj", "linear_q_up_proj"])
    return [f"self_attention.{m}" for m in (*q, "linear_kv_down_proj", "linear_kv_up_proj",
                                            "linear_proj")]
