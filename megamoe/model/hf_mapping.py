"""Hugging Face Llama / Mixtral state dict -> GPTModel state dict.

Accepts both expert layouts transformers uses: the on-disk per-expert keys
(`block_sparse_moe.experts.{e}.w1/w2/w3.weight`) and the fused in-memory layout of
transformers 5.x (`mlp.experts.gate_up_proj` [E, 2F, H] = cat(w1, w3), `down_proj`
[E, H, F]). Every input key must be consumed: an unmapped key is an error, never a silently
dropped weight.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megamoe.config import ModelConfig

Tensor = torch.Tensor


def _pad_vocab(w_VH: Tensor, config: ModelConfig) -> Tensor:
    """Append zero rows up to padded_vocab_size (they never reach the softmax)."""
    pad = config.padded_vocab_size - w_VH.shape[0]
    if pad < 0:
        raise ValueError(f"checkpoint vocabulary {w_VH.shape[0]} > padded_vocab_size "
                         f"{config.padded_vocab_size}")
    return torch.cat([w_VH, w_VH.new_zeros(pad, w_VH.shape[1])]) if pad else w_VH


def _experts(src: dict[str, Tensor], prefix: str, num_experts: int) -> tuple[Tensor, Tensor]:
    """(fc1_weight [E, H, 2F], fc2_weight [E, F, H]) from either HF expert layout."""
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in src:
        gate_up_E2FH = src.pop(fused)
        down_EHF = src.pop(f"{prefix}.experts.down_proj")
        return gate_up_E2FH.transpose(1, 2).contiguous(), down_EHF.transpose(1, 2).contiguous()
    fc1, fc2 = [], []
    for e in range(num_experts):
        p = f"{prefix}.experts.{e}"
        w1_FH, w3_FH = src.pop(f"{p}.w1.weight"), src.pop(f"{p}.w3.weight")
        fc1.append(torch.cat([w1_FH, w3_FH]).t())  # [H, 2F]
        fc2.append(src.pop(f"{p}.w2.weight").t())  # [F, H]
    return torch.stack(fc1).contiguous(), torch.stack(fc2).contiguous()


def hf_to_megamoe(hf_state_dict: Mapping[str, Tensor], config: ModelConfig
                  ) -> dict[str, Tensor]:
    """Map a Llama/Mixtral (RMSNorm, RoPE, swiglu) HF state dict onto GPTModel's names."""
    src = {k: v for k, v in hf_state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    out: dict[str, Tensor] = {
        "embedding.word_embeddings.weight": _pad_vocab(src.pop("model.embed_tokens.weight"),
                                                       config),
        "decoder.final_layernorm.weight": src.pop("model.norm.weight"),
    }
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = _pad_vocab(src.pop("lm_head.weight"), config)
    else:
        src.pop("lm_head.weight", None)  # tied: same tensor as embed_tokens
    for i in range(config.num_layers):
        hf, mm = f"model.layers.{i}", f"decoder.layers.{i}"
        out[f"{mm}.input_layernorm.weight"] = src.pop(f"{hf}.input_layernorm.weight")
        out[f"{mm}.pre_mlp_layernorm.weight"] = src.pop(f"{hf}.post_attention_layernorm.weight")
        for kind in ("weight", "bias"):
            qkv = [src.pop(f"{hf}.self_attn.{n}_proj.{kind}", None) for n in "qkv"]
            if all(t is not None for t in qkv):
                out[f"{mm}.self_attention.linear_qkv.{kind}"] = torch.cat(qkv)
            proj = src.pop(f"{hf}.self_attn.o_proj.{kind}", None)
            if proj is not None:
                out[f"{mm}.self_attention.linear_proj.{kind}"] = proj
        if config.is_moe_layer(i):
            prefix = next((f"{hf}.{n}" for n in ("mlp", "block_sparse_moe")
                           if f"{hf}.{n}.gate.weight" in src), None)
            if prefix is None:
                raise KeyError(f"no router weight for MoE layer {i} "
                               f"({hf}.mlp.gate.weight / {hf}.block_sparse_moe.gate.weight)")
            out[f"{mm}.mlp.router.weight"] = src.pop(f"{prefix}.gate.weight")
            fc1, fc2 = _experts(src, prefix, config.moe.num_experts)
            out[f"{mm}.mlp.experts.fc1_weight"] = fc1
            out[f"{mm}.mlp.experts.fc2_weight"] = fc2
        else:
            out[f"{mm}.mlp.linear_fc1.weight"] = torch.cat(
                [src.pop(f"{hf}.mlp.gate_proj.weight"), src.pop(f"{hf}.mlp.up_proj.weight")])
            out[f"{mm}.mlp.linear_fc2.weight"] = src.pop(f"{hf}.mlp.down_proj.weight")
    if src:
        raise KeyError(f"unmapped Hugging Face keys: {sorted(src)[:8]}"
                       f"{' ...' if len(src) > 8 else ''}")
    return out


def megamoe_to_hf(state_dict: Mapping[str, Tensor], config: ModelConfig, *,
                  fused_experts: bool = False) -> dict[str, Tensor]:
    """GPTModel state dict -> Mixtral/Llama HF names; the exact inverse of hf_to_megamoe.

    Experts come out per expert as transformers writes them to disk
    (`block_sparse_moe.experts.{e}.w1` gate [F, H], `w3` up [F, H], `w2` down [H, F]), or
    with `fused_experts` in the in-memory transformers 5.x layout (`mlp.experts.gate_up_proj`
    [E, 2F, H], `down_proj` [E, H, F]). Padded vocabulary rows are dropped. Every GPTModel
    key must be consumed.
    """
    src = dict(state_dict)
    v = config.vocab_size
    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": src.pop("embedding.word_embeddings.weight")[:v],
        "model.norm.weight": src.pop("decoder.final_layernorm.weight"),
    }
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = src.pop("output_layer.weight")[:v]
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    splits = [heads * d, groups * d, groups * d]
    for i in range(config.num_layers):
        hf, mm = f"model.layers.{i}", f"decoder.layers.{i}"
        out[f"{hf}.input_layernorm.weight"] = src.pop(f"{mm}.input_layernorm.weight")
        out[f"{hf}.post_attention_layernorm.weight"] = src.pop(f"{mm}.pre_mlp_layernorm.weight")
        for kind in ("weight", "bias"):
            qkv = src.pop(f"{mm}.self_attention.linear_qkv.{kind}", None)
            if qkv is not None:
                for n, t in zip("qkv", qkv.split(splits)):
                    out[f"{hf}.self_attn.{n}_proj.{kind}"] = t
            proj = src.pop(f"{mm}.self_attention.linear_proj.{kind}", None)
            if proj is not None:
                out[f"{hf}.self_attn.o_proj.{kind}"] = proj
        if config.is_moe_layer(i):
            prefix = f"{hf}.mlp" if fused_experts else f"{hf}.block_sparse_moe"
            out[f"{prefix}.gate.weight"] = src.pop(f"{mm}.mlp.router.weight")
            fc1_EH2F = src.pop(f"{mm}.mlp.experts.fc1_weight")
            fc2_EFH = src.pop(f"{mm}.mlp.experts.fc2_weight")
            if fused_experts:
                out[f"{prefix}.experts.gate_up_proj"] = fc1_EH2F.transpose(1, 2).contiguous()
                out[f"{prefix}.experts.down_proj"] = fc2_EFH.transpose(1, 2).contiguous()
                continue
            for e in range(fc1_EH2F.shape[0]):
                w1_FH, w3_FH = fc1_EH2F[e].t().chunk(2, dim=0)  # [2F, H] = cat(gate, up)
                out[f"{prefix}.experts.{e}.w1.weight"] = w1_FH.contiguous()
                out[f"{prefix}.experts.{e}.w3.weight"] = w3_FH.contiguous()
                out[f"{prefix}.experts.{e}.w2.weight"] = fc2_EFH[e].t().contiguous()
        else:
            gate_FH, up_FH = src.pop(f"{mm}.mlp.linear_fc1.weight").chunk(2, dim=0)
            out[f"{hf}.mlp.gate_proj.weight"] = gate_FH
            out[f"{hf}.mlp.up_proj.weight"] = up_FH
            out[f"{hf}.mlp.down_proj.weight"] = src.pop(f"{mm}.mlp.linear_fc2.weight")
    if src:
        raise KeyError(f"GPTModel keys with no Hugging Face name: {sorted(src)[:8]}"
                       f"{' ...' if len(src) > 8 else ''}")
    return out
