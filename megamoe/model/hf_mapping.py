"""Hugging Face decoder state dicts <-> GPTModel state dicts, for the MoE families of
`hf_families.py` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; Llama for dense models).

One `WeightMap` holds the mapping; the families differ only in names (`HFNames`: where the
MoE block lives, what the experts' three matrices are called) and in which optional
tensors they carry (q/k norms, QKV biases, a gated shared expert, dense layers between MoE
layers), which the GPTModel config says. A family whose attention or MLP is laid out
differently (DeepSeek-V3's multi-latent attention) subclasses WeightMap and overrides
`attention_to_megamoe` / `attention_to_hf`.

Both expert layouts transformers uses are read: the on-disk per-expert keys
(`{moe_block}.experts.{e}.{gate}/{up}/{down}.weight`) and the fused in-memory layout of
transformers 5.x (`mlp.experts.gate_up_proj` [E, 2F, H] = cat(gate, up), `down_proj`
[E, H, F]). Every input key must be consumed: an unmapped key is an error, never a silently
dropped weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megamoe.config import ModelConfig

Tensor = torch.Tensor


@dataclass(frozen=True)
class HFNames:
    """A family's Hugging Face weight names (on disk, as save_pretrained writes them)."""

    moe_block: str = "mlp"  # Mixtral: block_sparse_moe
    expert_gate: str = "gate_proj"  # Mixtral: w1
    expert_up: str = "up_proj"  # Mixtral: w3
    expert_down: str = "down_proj"  # Mixtral: w2


MIXTRAL_NAMES = HFNames("block_sparse_moe", "w1", "w3", "w2")
QWEN_NAMES = HFNames()


def _pad_vocab(w_VH: Tensor, config: ModelConfig) -> Tensor:
    """Append zero rows up to padded_vocab_size (they never reach the softmax)."""
    pad = config.padded_vocab_size - w_VH.shape[0]
    if pad < 0:
        raise ValueError(f"checkpoint vocabulary {w_VH.shape[0]} > padded_vocab_size "
                         f"{config.padded_vocab_size}")
    return torch.cat([w_VH, w_VH.new_zeros(pad, w_VH.shape[1])]) if pad else w_VH


def _unmapped(src: Mapping[str, Tensor], what: str) -> None:
    if src:
        raise KeyError(f"{what}: {sorted(src)[:8]}{' ...' if len(src) > 8 else ''}")


class WeightMap:
    """HF <-> GPTModel names and layouts for one family's `HFNames`."""

    def __init__(self, names: HFNames):
        self.names = names

    # ------------------------------------------------------------ HF -> GPTModel

    def to_megamoe(self, hf_state_dict: Mapping[str, Tensor], config: ModelConfig
                   ) -> dict[str, Tensor]:
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
            out[f"{mm}.pre_mlp_layernorm.weight"] = src.pop(
                f"{hf}.post_attention_layernorm.weight")
            self.attention_to_megamoe(src, out, f"{hf}.self_attn", f"{mm}.self_attention")
            if config.is_moe_layer(i):
                self.moe_to_megamoe(src, out, hf, f"{mm}.mlp", config)
            else:
                out.update(self._mlp_to_megamoe(src, f"{hf}.mlp", f"{mm}.mlp"))
        _unmapped(src, "unmapped Hugging Face keys")
        return out

    def attention_to_megamoe(self, src: dict, out: dict, hf: str, mm: str) -> None:
        """q/k/v(/o) weights and biases, and q/k norms when present (either scope: the
        config decides the shapes, which the converter checks)."""
        for kind in ("weight", "bias"):
            qkv = [src.pop(f"{hf}.{n}_proj.{kind}", None) for n in "qkv"]
            if all(t is not None for t in qkv):
                out[f"{mm}.linear_qkv.{kind}"] = torch.cat(qkv)
            proj = src.pop(f"{hf}.o_proj.{kind}", None)
            if proj is not None:
                out[f"{mm}.linear_proj.{kind}"] = proj
        for n in "qk":
            norm = src.pop(f"{hf}.{n}_norm.weight", None)
            if norm is not None:
                out[f"{mm}.{n}_layernorm.weight"] = norm

    @staticmethod
    def _mlp_to_megamoe(src: dict, hf: str, mm: str) -> dict[str, Tensor]:
        """A swiglu MLP (gate_proj, up_proj, down_proj) -> linear_fc1 = cat(gate, up)."""
        return {f"{mm}.linear_fc1.weight": torch.cat([src.pop(f"{hf}.gate_proj.weight"),
                                                      src.pop(f"{hf}.up_proj.weight")]),
                f"{mm}.linear_fc2.weight": src.pop(f"{hf}.down_proj.weight")}

    def moe_to_megamoe(self, src: dict, out: dict, hf_layer: str, mm: str,
                       config: ModelConfig) -> None:
        prefix = next((f"{hf_layer}.{n}" for n in (self.names.moe_block, "mlp")
                       if f"{hf_layer}.{n}.gate.weight" in src), None)
        if prefix is None:
            raise KeyError(f"no router weight for MoE layer {hf_layer} "
                           f"({hf_layer}.{self.names.moe_block}.gate.weight)")
        out[f"{mm}.router.weight"] = src.pop(f"{prefix}.gate.weight")
        fc1, fc2 = self._experts(src, prefix, config.moe.num_experts)
        out[f"{mm}.experts.fc1_weight"] = fc1
        out[f"{mm}.experts.fc2_weight"] = fc2
        if config.moe.shared_expert_intermediate_size is not None:
            out.update(self._mlp_to_megamoe(src, f"{prefix}.shared_expert",
                                            f"{mm}.shared_experts"))
            gate = src.pop(f"{prefix}.shared_expert_gate.weight", None)
            if gate is not None:
                out[f"{mm}.shared_experts.gate_weight"] = gate

    def _experts(self, src: dict, prefix: str, num_experts: int) -> tuple[Tensor, Tensor]:
        """(fc1_weight [E, H, 2F], fc2_weight [E, F, H]) from either HF expert layout."""
        fused = f"{prefix}.experts.gate_up_proj"
        if fused in src:
            gate_up_E2FH = src.pop(fused)
            down_EHF = src.pop(f"{prefix}.experts.down_proj")
            return (gate_up_E2FH.transpose(1, 2).contiguous(),
                    down_EHF.transpose(1, 2).contiguous())
        n = self.names
        fc1, fc2 = [], []
        for e in range(num_experts):
            p = f"{prefix}.experts.{e}"
            gate_FH, up_FH = src.pop(f"{p}.{n.expert_gate}.weight"), src.pop(
                f"{p}.{n.expert_up}.weight")
            fc1.append(torch.cat([gate_FH, up_FH]).t())  # [H, 2F]
            fc2.append(src.pop(f"{p}.{n.expert_down}.weight").t())  # [F, H]
        return torch.stack(fc1).contiguous(), torch.stack(fc2).contiguous()

    # ------------------------------------------------------------ GPTModel -> HF

    def to_hf(self, state_dict: Mapping[str, Tensor], config: ModelConfig, *,
              fused_experts: bool = False) -> dict[str, Tensor]:
        """The exact inverse of `to_megamoe`: experts per expert as transformers writes them
        to disk, or with `fused_experts` in the in-memory transformers 5.x layout. Padded
        vocabulary rows are dropped. Every GPTModel key must be consumed."""
        src = dict(state_dict)
        v = config.vocab_size
        out: dict[str, Tensor] = {
            "model.embed_tokens.weight": src.pop("embedding.word_embeddings.weight")[:v],
            "model.norm.weight": src.pop("decoder.final_layernorm.weight"),
        }
        if config.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = src.pop("output_layer.weight")[:v]
        for i in range(config.num_layers):
            hf, mm = f"model.layers.{i}", f"decoder.layers.{i}"
            out[f"{hf}.input_layernorm.weight"] = src.pop(f"{mm}.input_layernorm.weight")
            out[f"{hf}.post_attention_layernorm.weight"] = src.pop(
                f"{mm}.pre_mlp_layernorm.weight")
            self.attention_to_hf(src, out, f"{hf}.self_attn", f"{mm}.self_attention", config)
            if config.is_moe_layer(i):
                self.moe_to_hf(src, out, hf, f"{mm}.mlp", fused_experts)
            else:
                out.update(self._mlp_to_hf(src, f"{hf}.mlp", f"{mm}.mlp"))
        _unmapped(src, "GPTModel keys with no Hugging Face name")
        return out

    def attention_to_hf(self, src: dict, out: dict, hf: str, mm: str,
                        config: ModelConfig) -> None:
        d = config.kv_channels
        splits = [config.num_attention_heads * d, config.num_query_groups * d,
                  config.num_query_groups * d]
        for kind in ("weight", "bias"):
            qkv = src.pop(f"{mm}.linear_qkv.{kind}", None)
            if qkv is not None:
                for n, t in zip("qkv", qkv.split(splits)):
                    out[f"{hf}.{n}_proj.{kind}"] = t
            proj = src.pop(f"{mm}.linear_proj.{kind}", None)
            if proj is not None:
                out[f"{hf}.o_proj.{kind}"] = proj
        for n in "qk":
            norm = src.pop(f"{mm}.{n}_layernorm.weight", None)
            if norm is not None:
                out[f"{hf}.{n}_norm.weight"] = norm

    @staticmethod
    def _mlp_to_hf(src: dict, hf: str, mm: str) -> dict[str, Tensor]:
        gate_FH, up_FH = src.pop(f"{mm}.linear_fc1.weight").chunk(2, dim=0)
        return {f"{hf}.gate_proj.weight": gate_FH, f"{hf}.up_proj.weight": up_FH,
                f"{hf}.down_proj.weight": src.pop(f"{mm}.linear_fc2.weight")}

    def moe_to_hf(self, src: dict, out: dict, hf_layer: str, mm: str,
                  fused_experts: bool) -> None:
        n = self.names
        prefix = f"{hf_layer}.mlp" if fused_experts else f"{hf_layer}.{n.moe_block}"
        out[f"{prefix}.gate.weight"] = src.pop(f"{mm}.router.weight")
        fc1_EH2F = src.pop(f"{mm}.experts.fc1_weight")
        fc2_EFH = src.pop(f"{mm}.experts.fc2_weight")
        if f"{mm}.shared_experts.linear_fc1.weight" in src:
            out.update(self._mlp_to_hf(src, f"{prefix}.shared_expert", f"{mm}.shared_experts"))
            gate = src.pop(f"{mm}.shared_experts.gate_weight", None)
            if gate is not None:
                out[f"{prefix}.shared_expert_gate.weight"] = gate
        if fused_experts:
            out[f"{prefix}.experts.gate_up_proj"] = fc1_EH2F.transpose(1, 2).contiguous()
            out[f"{prefix}.experts.down_proj"] = fc2_EFH.transpose(1, 2).contiguous()
            return
        for e in range(fc1_EH2F.shape[0]):
            gate_FH, up_FH = fc1_EH2F[e].t().chunk(2, dim=0)  # [2F, H] = cat(gate, up)
            out[f"{prefix}.experts.{e}.{n.expert_gate}.weight"] = gate_FH.contiguous()
            out[f"{prefix}.experts.{e}.{n.expert_up}.weight"] = up_FH.contiguous()
            out[f"{prefix}.experts.{e}.{n.expert_down}.weight"] = fc2_EFH[e].t().contiguous()


MIXTRAL = WeightMap(MIXTRAL_NAMES)


def hf_to_megamoe(hf_state_dict: Mapping[str, Tensor], config: ModelConfig,
                  weights: WeightMap = MIXTRAL) -> dict[str, Tensor]:
    """Map a HF state dict (Mixtral/Llama names by default) onto GPTModel's names."""
    return weights.to_megamoe(hf_state_dict, config)


def megamoe_to_hf(state_dict: Mapping[str, Tensor], config: ModelConfig, *,
                  fused_experts: bool = False, weights: WeightMap = MIXTRAL
                  ) -> dict[str, Tensor]:
    """GPTModel state dict -> HF names (Mixtral's by default); the inverse of
    hf_to_megamoe."""
    return weights.to_hf(state_dict, config, fused_experts=fused_experts)
