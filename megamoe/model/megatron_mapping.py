"""Megatron-LM (megatron-core) torch_dist tensor names and layouts <-> GPTModel state dicts.

What megatron-core 0.19 writes with `dist_checkpointing.save(model.sharded_state_dict())`
(verified against real saves in tests/tools/megatron_peer):

- layers stacked on a leading dim (`decoder.layers.self_attention.linear_qkv.weight`
  [L, ...]) when every layer is alike; one key per layer (`decoder.layers.{i}.…`) when they
  differ (`--moe-layer-freq` with dense layers). Both are read; `stacked_layers` says which
  one megatron-core itself writes, and writing follows it.
- experts stacked on the expert dim: `mlp.experts.experts.linear_fc1.weight` [E, 2F, H]
  (gate rows then up rows), `linear_fc2.weight` [E, H, F]; GPTModel keeps them transposed
  (`experts.fc1_weight` [E, H, 2F], `fc2_weight` [E, F, H]).
- attention: `linear_qkv.weight` is interleaved per query group, [g0: q.., k, v | g1: ...]
  (rows of kv_channels), GPTModel's is cat(all q, all k, all v).
- norms: the input norm is `self_attention.linear_qkv.layer_norm_weight` (both specs); the
  pre-MLP norm is `mlp.linear_fc1.layer_norm_weight` in dense layers (both specs) and in
  the local spec's MoE layers, `pre_mlp_layernorm.weight` in the TE spec's MoE layers.
- multi-latent attention and MTP depths: megatron_mla.py.
- `*._extra_state` byte items (TE's FP8 metadata; None for local modules) carry no weight.

Every input tensor must be consumed: an unmapped key is an error, never a dropped weight.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megamoe.config import ModelConfig
from megamoe.model.megatron_mla import MTP_OWN, mla_to_megamoe, mla_to_megatron

Tensor = torch.Tensor
SPECS = ("te", "local")


def stacked_layers(config: ModelConfig) -> bool:
    """Whether megatron-core writes this model's layers stacked on dim 0: only when every
    layer is alike (no dense layers among MoE ones; megatron-core's TransformerBlock
    sharded_state_dict, `non_homogeneous_layers`)."""
    pattern = config.moe_layer_pattern
    return pattern is None or len(set(pattern)) == 1


def qkv_to_megamoe(w: Tensor, config: ModelConfig) -> Tensor:
    """Megatron's per-group interleaved [g: q.., k, v] rows -> cat(q, k, v) (dim 0)."""
    g, d = config.num_query_groups, config.kv_channels
    per = config.num_attention_heads // g
    w_G = w.reshape(g, per + 2, d, *w.shape[1:])
    q, k, v = w_G[:, :per], w_G[:, per], w_G[:, per + 1]
    return torch.cat([q.reshape(-1, *w.shape[1:]), k.reshape(-1, *w.shape[1:]),
                      v.reshape(-1, *w.shape[1:])])


def qkv_to_megatron(w: Tensor, config: ModelConfig) -> Tensor:
    """The inverse of qkv_to_megamoe."""
    g, d = config.num_query_groups, config.kv_channels
    per = config.num_attention_heads // g
    rest = tuple(w.shape[1:])
    q, k, v = w.split([g * per * d, g * d, g * d])
    return torch.cat([q.reshape(g, per, d, *rest), k.reshape(g, 1, d, *rest),
                      v.reshape(g, 1, d, *rest)], dim=1).reshape(-1, *rest).contiguous()


def unstack_layers(src: Mapping[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """`decoder.layers.X` [L, ...] -> `decoder.layers.{i}.X`; per-layer keys pass through."""
    out: dict[str, Tensor] = {}
    for key, t in src.items():
        if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
            if t.dim() == 0 or t.shape[0] != num_layers:
                raise ValueError(f"{key} has shape {list(t.shape)}, stacked layers need "
                                 f"{num_layers} rows on dim 0")
            rest = key[len("decoder.layers."):]
            for i in range(num_layers):
                out[f"decoder.layers.{i}.{rest}"] = t[i]
        else:
            out[key] = t
    return out


def _pad_vocab(w_VH: Tensor, config: ModelConfig) -> Tensor:
    """Megatron's padded rows -> GPTModel's padded size. Rows past vocab_size are padding
    (GPTModel masks them out of the softmax): kept as they are when both paddings agree
    (so a round trip is exact), else the real vocabulary is carried, zero-padded."""
    v, padded = config.vocab_size, config.padded_vocab_size
    if w_VH.shape[0] == padded:
        return w_VH
    if w_VH.shape[0] < v:
        raise ValueError(f"the vocabulary has {w_VH.shape[0]} rows, fewer than the "
                         f"vocab_size {v}")
    w_VH = w_VH[:v]
    return torch.cat([w_VH, w_VH.new_zeros(padded - v, w_VH.shape[1])]) if padded > v else w_VH


def _pop_one(src: dict, names: list[str], what: str) -> Tensor:
    found = [n for n in names if n in src]
    if len(found) != 1:
        raise KeyError(f"{what}: expected one of {names}, found {found or 'none'}")
    return src.pop(found[0])


def _experts(src: dict, prefix: str, fc: str, config: ModelConfig) -> Tensor:
    """[E, ...] of one expert matrix: stacked (`{prefix}.{fc}.weight`), or one key per
    expert (`{prefix}.{e}.{fc}.weight`, megatron-core's singleton_local_shards saves)."""
    key = f"{prefix}.{fc}.weight"
    if key in src:
        return src.pop(key)
    keys = [f"{prefix}.{e}.{fc}.weight" for e in range(config.moe.num_experts)]
    missing = [k for k in keys if k not in src]
    if missing:
        raise KeyError(f"no expert weights {key} (nor per expert: {missing[0]})")
    return torch.stack([src.pop(k) for k in keys])


def to_megamoe(megatron_sd: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """megatron-core tensors (either layer layout, either spec) -> GPTModel's state dict."""
    src = unstack_layers({k: v for k, v in megatron_sd.items()
                          if "_extra_state" not in k}, config.num_layers)
    out = {"embedding.word_embeddings.weight":
           _pad_vocab(src.pop("embedding.word_embeddings.weight"), config),
           "decoder.final_layernorm.weight": src.pop("decoder.final_layernorm.weight")}
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = _pad_vocab(src.pop("output_layer.weight"), config)
    for i in range(config.num_layers):
        _layer_to_megamoe(src, out, f"decoder.layers.{i}", f"decoder.layers.{i}", i, config)
    for k in range(config.num_mtp_layers):
        depth = f"mtp.layers.{k}"
        for name in MTP_OWN:
            out[f"{depth}.{name}"] = src.pop(f"{depth}.{name}")
        _layer_to_megamoe(src, out, f"{depth}.transformer_layer",
                          f"{depth}.transformer_layer", config.num_layers + k, config)
    if src:
        raise KeyError(f"Megatron tensors with no megamoe name: {sorted(src)[:6]}"
                       f"{' ...' if len(src) > 6 else ''}")
    return out


def _layer_to_megamoe(src: dict, out: dict, mg: str, mm: str, i: int,
                      config: ModelConfig) -> None:
    """Pop transformer layer `i`'s tensors (Megatron prefix `mg`) into `out` (prefix
    `mm`); `i` >= num_layers: an MTP depth's layer."""
    att = f"{mg}.self_attention"
    out[f"{mm}.input_layernorm.weight"] = _pop_one(
        src, [f"{att}.linear_qkv.layer_norm_weight", f"{mg}.input_layernorm.weight"],
        f"layer {i} input norm")
    if config.multi_latent_attention:
        out.update(mla_to_megamoe(src, att, f"{mm}.self_attention"))
    else:
        out[f"{mm}.self_attention.linear_qkv.weight"] = qkv_to_megamoe(
            src.pop(f"{att}.linear_qkv.weight"), config)
        if f"{att}.linear_qkv.bias" in src:
            out[f"{mm}.self_attention.linear_qkv.bias"] = qkv_to_megamoe(
                src.pop(f"{att}.linear_qkv.bias"), config)
        for name in ("linear_proj.weight", "linear_proj.bias", "q_layernorm.weight",
                     "k_layernorm.weight"):
            if f"{att}.{name}" in src:
                out[f"{mm}.self_attention.{name}"] = src.pop(f"{att}.{name}")
    out[f"{mm}.pre_mlp_layernorm.weight"] = _pop_one(
        src, [f"{mg}.mlp.linear_fc1.layer_norm_weight", f"{mg}.pre_mlp_layernorm.weight"],
        f"layer {i} pre-MLP norm")
    mlp = f"{mg}.mlp"
    if not config.is_moe_layer(i):
        for name in ("linear_fc1.weight", "linear_fc2.weight"):
            out[f"{mm}.mlp.{name}"] = src.pop(f"{mlp}.{name}")
        return
    out[f"{mm}.mlp.router.weight"] = src.pop(f"{mlp}.router.weight")
    if f"{mlp}.router.expert_bias" in src:
        out[f"{mm}.mlp.router.expert_bias"] = src.pop(f"{mlp}.router.expert_bias")
    fc1_E2FH = _experts(src, f"{mlp}.experts.experts", "linear_fc1", config)
    fc2_EHF = _experts(src, f"{mlp}.experts.experts", "linear_fc2", config)
    out[f"{mm}.mlp.experts.fc1_weight"] = fc1_E2FH.transpose(1, 2).contiguous()
    out[f"{mm}.mlp.experts.fc2_weight"] = fc2_EHF.transpose(1, 2).contiguous()
    for name in ("linear_fc1.weight", "linear_fc2.weight", "gate_weight"):
        if f"{mlp}.shared_experts.{name}" in src:
            out[f"{mm}.mlp.shared_experts.{name}"] = src.pop(f"{mlp}.shared_experts.{name}")


def to_megatron(state_dict: Mapping[str, Tensor], config: ModelConfig, spec: str = "te"
                ) -> dict[str, Tensor]:
    """GPTModel's state dict -> megatron-core's torch_dist tensors for a `spec` ("te" or
    "local") model, in the layer layout megatron-core writes (`stacked_layers`; MTP
    depths one key each). Padded vocabulary rows are written as GPTModel holds them
    (zeros past vocab_size)."""
    if spec not in SPECS:
        raise ValueError(f"spec must be one of {SPECS}, got {spec!r}")
    src = dict(state_dict)
    out = {"embedding.word_embeddings.weight": src.pop("embedding.word_embeddings.weight"),
           "decoder.final_layernorm.weight": src.pop("decoder.final_layernorm.weight")}
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = src.pop("output_layer.weight")
    layers = [_layer_to_megatron(src, f"decoder.layers.{i}", i, config, spec)
              for i in range(config.num_layers)]
    for k in range(config.num_mtp_layers):
        depth = f"mtp.layers.{k}"
        for name in MTP_OWN:
            out[f"{depth}.{name}"] = src.pop(f"{depth}.{name}")
        lay = _layer_to_megatron(src, f"{depth}.transformer_layer", config.num_layers + k,
                                 config, spec)
        out.update({f"{depth}.transformer_layer.{n}": t for n, t in lay.items()})
    if src:
        raise KeyError(f"GPTModel keys with no Megatron name: {sorted(src)[:6]}")
    if stacked_layers(config):
        for name in layers[0]:
            out[f"decoder.layers.{name}"] = torch.stack([lay[name] for lay in layers])
    else:
        for i, lay in enumerate(layers):
            out.update({f"decoder.layers.{i}.{name}": t for name, t in lay.items()})
    return out


def _layer_to_megatron(src: dict, mm: str, i: int, config: ModelConfig, spec: str
                       ) -> dict[str, Tensor]:
    """Pop transformer layer `i`'s tensors (megamoe prefix `mm`); return them under
    Megatron's names relative to the layer."""
    lay: dict[str, Tensor] = {}
    moe = config.is_moe_layer(i)
    if config.multi_latent_attention:  # norms apart from the projections (megatron_mla.py)
        lay["input_layernorm.weight"] = src.pop(f"{mm}.input_layernorm.weight")
        lay.update(mla_to_megatron(src, f"{mm}.self_attention", spec))
        norm = ("mlp.linear_fc1.layer_norm_weight" if spec == "te" and not moe
                else "pre_mlp_layernorm.weight")
    else:
        lay["self_attention.linear_qkv.layer_norm_weight"] = src.pop(
            f"{mm}.input_layernorm.weight")
        for name in ("weight", "bias"):
            if f"{mm}.self_attention.linear_qkv.{name}" in src:
                lay[f"self_attention.linear_qkv.{name}"] = qkv_to_megatron(
                    src.pop(f"{mm}.self_attention.linear_qkv.{name}"), config)
        for name in ("linear_proj.weight", "linear_proj.bias", "q_layernorm.weight",
                     "k_layernorm.weight"):
            if f"{mm}.self_attention.{name}" in src:
                lay[f"self_attention.{name}"] = src.pop(f"{mm}.self_attention.{name}")
        norm = ("pre_mlp_layernorm.weight" if moe and spec == "te"
                else "mlp.linear_fc1.layer_norm_weight")
    lay[norm] = src.pop(f"{mm}.pre_mlp_layernorm.weight")
    for key in [k for k in src if k.startswith(f"{mm}.mlp.")]:
        name, t = key[len(f"{mm}."):], src.pop(key)
        if name == "mlp.experts.fc1_weight":
            lay["mlp.experts.experts.linear_fc1.weight"] = t.transpose(1, 2).contiguous()
        elif name == "mlp.experts.fc2_weight":
            lay["mlp.experts.experts.linear_fc2.weight"] = t.transpose(1, 2).contiguous()
        else:
            lay[name] = t
    return lay
