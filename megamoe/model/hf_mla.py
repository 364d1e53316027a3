"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`) <-> GPTModel weights: the attention
(`DeepseekV3Attention` <-> MLASelfAttention, one layer at a time) and the whole model
(`DeepSeekV3Weights`, with the router's correction bias, shared experts and MTP layers).

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

from collections.abc import Mapping

import torch

from megamoe.config import ModelConfig
from megamoe.model.hf_mapping import QWEN_NAMES, WeightMap, _unmapped

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


class DeepSeekV3Weights(WeightMap):
    """DeepseekV3ForCausalLM <-> GPTModel: multi-latent attention (the renames above), a
    sigmoid router whose `e_score_correction_bias` is megamoe's `router.expert_bias`, the
    shared experts (`mlp.shared_experts.*`, no gate), dense first layers, and the MTP
    depths DeepSeek's files store as extra layers `model.layers.{N + k}` (N =
    num_hidden_layers): enorm, hnorm, eh_proj, a decoder layer's tensors, and
    shared_head.norm = megamoe's mtp final_layernorm. Each MTP layer's `embed_tokens` and
    `shared_head.head` are copies of the model's embedding and output layer: on import
    they must equal them (megamoe shares one tensor), on export they are written out as
    DeepSeek's files carry them. transformers builds no MTP module and ignores them."""

    def __init__(self):
        super().__init__(QWEN_NAMES)

    # ------------------------------------------------------------ HF -> GPTModel

    def to_megamoe(self, hf_state_dict: Mapping[str, Tensor], config: ModelConfig
                   ) -> dict[str, Tensor]:
        main, mtp = {}, {}
        for k, t in hf_state_dict.items():
            layer = k.split(".")[2] if k.startswith("model.layers.") else None
            (mtp if layer is not None and int(layer) >= config.num_layers else main)[k] = t
        out = super().to_megamoe(main, config)
        for depth in range(config.mtp_num_layers or 0):
            self._mtp_to_megamoe(mtp, out, depth, config)
        _unmapped(mtp, "unmapped Hugging Face keys")
        return out

    def _mtp_to_megamoe(self, src: dict, out: dict, depth: int, config: ModelConfig) -> None:
        hf, mm = f"model.layers.{config.num_layers + depth}", f"mtp.layers.{depth}"
        for name, shared in (("embed_tokens.weight", "embedding.word_embeddings.weight"),
                             ("shared_head.head.weight", "output_layer.weight")):
            copy = src.pop(f"{hf}.{name}", None)
            whole = out.get(shared, out["embedding.word_embeddings.weight"])
            if copy is not None and not torch.equal(copy, whole[:copy.shape[0]]):
                raise ValueError(f"{hf}.{name} differs from the model's {shared} (megamoe's "
                                 "MTP shares it)")
        for name in ("enorm", "hnorm", "eh_proj"):
            out[f"{mm}.{name}.weight"] = src.pop(f"{hf}.{name}.weight")
        out[f"{mm}.final_layernorm.weight"] = src.pop(f"{hf}.shared_head.norm.weight")
        layer = f"{mm}.transformer_layer"
        out[f"{layer}.input_layernorm.weight"] = src.pop(f"{hf}.input_layernorm.weight")
        out[f"{layer}.pre_mlp_layernorm.weight"] = src.pop(
            f"{hf}.post_attention_layernorm.weight")
        self.attention_to_megamoe(src, out, f"{hf}.self_attn", f"{layer}.self_attention")
        self.moe_to_megamoe(src, out, hf, f"{layer}.mlp", config)

    def attention_to_megamoe(self, src: dict, out: dict, hf: str, mm: str) -> None:
        out.update(mla_from_hf(src, hf, mm))

    def moe_to_megamoe(self, src: dict, out: dict, hf_layer: str, mm: str,
                       config: ModelConfig) -> None:
        prefix = f"{hf_layer}.mlp"
        out[f"{mm}.router.weight"] = src.pop(f"{prefix}.gate.weight")
        out[f"{mm}.router.expert_bias"] = src.pop(
            f"{prefix}.gate.e_score_correction_bias").float()
        fc1, fc2 = self._experts(src, prefix, config.moe.num_experts)
        out[f"{mm}.experts.fc1_weight"], out[f"{mm}.experts.fc2_weight"] = fc1, fc2
        out.update(self._mlp_to_megamoe(src, f"{prefix}.shared_experts", f"{mm}.shared_experts"))

    # ------------------------------------------------------------ GPTModel -> HF

    def to_hf(self, state_dict: Mapping[str, Tensor], config: ModelConfig, *,
              fused_experts: bool = False) -> dict[str, Tensor]:
        main = {k: t for k, t in state_dict.items() if not k.startswith("mtp.")}
        mtp = {k: t for k, t in state_dict.items() if k.startswith("mtp.")}
        out = super().to_hf(main, config, fused_experts=fused_experts)
        for depth in range(config.mtp_num_layers or 0):
            hf, mm = f"model.layers.{config.num_layers + depth}", f"mtp.layers.{depth}"
            out[f"{hf}.embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
            out[f"{hf}.shared_head.head.weight"] = out.get(
                "lm_head.weight", out["model.embed_tokens.weight"]).clone()
            for name in ("enorm", "hnorm", "eh_proj"):
                out[f"{hf}.{name}.weight"] = mtp.pop(f"{mm}.{name}.weight")
            out[f"{hf}.shared_head.norm.weight"] = mtp.pop(f"{mm}.final_layernorm.weight")
            layer = f"{mm}.transformer_layer"
            out[f"{hf}.input_layernorm.weight"] = mtp.pop(f"{layer}.input_layernorm.weight")
            out[f"{hf}.post_attention_layernorm.weight"] = mtp.pop(
                f"{layer}.pre_mlp_layernorm.weight")
            self.attention_to_hf(mtp, out, f"{hf}.self_attn", f"{layer}.self_attention",
                                 config)
            self.moe_to_hf(mtp, out, hf, f"{layer}.mlp", fused_experts)
        _unmapped(mtp, "GPTModel keys with no Hugging Face name")
        return out

    def attention_to_hf(self, src: dict, out: dict, hf: str, mm: str,
                        config: ModelConfig) -> None:
        out.update(mla_to_hf(src, mm, hf))

    def moe_to_hf(self, src: dict, out: dict, hf_layer: str, mm: str,
                  fused_experts: bool) -> None:
        prefix = f"{hf_layer}.mlp"
        out[f"{prefix}.gate.e_score_correction_bias"] = src.pop(f"{mm}.router.expert_bias")
        out.update(self._mlp_to_hf(src, f"{prefix}.shared_experts", f"{mm}.shared_experts"))
        super().moe_to_hf(src, out, hf_layer, mm, fused_experts)


DEEPSEEK_V3 = DeepSeekV3Weights()
