"""Megatron-LM's legacy per-rank model state dicts (`--ckpt-format torch`) -> one
megatron-core state dict with global names, which megatron_mapping.to_megamoe then maps.

Each `mp_rank_{tp}[_{pp}][_{ep}]/model_optim_rng.pt` holds its rank's pipeline chunk(s)
(`model`, or `model0..` with interleaving) as `state_dict()` gives them, so:

- layers are numbered within the chunk: global = offset + local, with megatron-core's
  even-split offset (get_transformer_layer_offset): v * L/V + p * L/(PP*V);
- experts are numbered within the expert-parallel rank: global = ep * E/EP + local, named
  `mlp.experts.local_experts.{i}.linear_fc{1,2}.weight` (SequentialMLP) or
  `mlp.experts.linear_fc{1,2}.weight{i}` (TEGroupedMLP);
- tensor-parallel shards are merged as megatron-core splits them: column-parallel on dim 0
  (vocabulary rows with their padding, the per-query-group qkv rows, which stay in
  megatron-core's interleaved order), row-parallel on dim 1, and SwiGLU's fc1 as per-rank
  [gate_r; up_r] halves (gate = cat(gate_r), up = cat(up_r)); expert weights split over
  the expert-tensor-parallel size (ETP = TP, Megatron's default, or 1); replicated tensors
  (norms, router, expert bias, shared-expert gate) are taken from the lowest rank;
- MLA (megatron_mla.py's names): the up projections and linear_q_proj column-parallel,
  the down projections column-parallel (local spec) or duplicated (TE spec), the latent
  norms replicated; MTP depths (`mtp.layers.{k}.`, on the last stage) as a layer, their
  eh_proj column-parallel, enorm / hnorm / final norm replicated, and the last stage's
  copy of the word embeddings (MTP's, kept equal to the first stage's) not used.

Every tensor name must have a known layout: an unknown one is an error, not a guess.
The output uses per-layer, per-expert names (`decoder.layers.{i}.mlp.experts.experts.
{e}.linear_fc1.weight`), one of the layouts to_megamoe reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

Tensor = torch.Tensor
StateDict = dict[str, Tensor]

COLUMN = {"embedding.word_embeddings.weight", "output_layer.weight",
          "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
          "self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight",
          "self_attention.linear_kv_up_proj.weight", "eh_proj.weight"}
# MLA's down projections: column-parallel in the local spec, duplicated (whole on every
# rank) in the TE spec; the saved args' sizes tell which (LegacyLayout.mla_down_rows).
MLA_DOWN = ("self_attention.linear_q_down_proj.weight",
            "self_attention.linear_kv_down_proj.weight")
ROW = {"self_attention.linear_proj.weight", "mlp.linear_fc2.weight",
       "mlp.shared_experts.linear_fc2.weight"}
GLU = {"mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"}
REPLICATED = {"decoder.final_layernorm.weight", "input_layernorm.weight",
              "pre_mlp_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
              "mlp.linear_fc1.layer_norm_weight", "self_attention.q_layernorm.weight",
              "self_attention.k_layernorm.weight", "self_attention.linear_proj.bias",
              "mlp.router.weight", "mlp.router.expert_bias", "mlp.shared_experts.gate_weight",
              "self_attention.kv_layernorm.weight",
              "self_attention.linear_q_up_proj.layer_norm_weight",
              "self_attention.linear_kv_up_proj.layer_norm_weight",
              "enorm.weight", "hnorm.weight", "final_layernorm.weight"}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# An MTP depth's transformer layer (`mtp_model_layer` in megatron-core 0.19's state_dict,
# `transformer_layer` before and in torch_dist), and the depth's own tensors.
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(?:mtp_model_layer|transformer_layer)\.(.+)")
_MTP_OWN = re.compile(r"mtp\.layers\.(\d+)\.((?:enorm|hnorm|eh_proj|final_layernorm)\.weight)")
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight"
                     r"|(linear_fc[12])\.weight(\d+))")


@dataclass(frozen=True)
class LegacyLayout:
    """The parallel layout a legacy checkpoint was saved with (from its args)."""

    tp: int
    pp: int
    ep: int
    etp: int
    vpp: Optional[int]
    num_layers: int
    num_experts: int
    swiglu: bool  # fc1 is [gate; up]: --swiglu or --quick-geglu
    tied: bool
    # MLA: the full rows of linear_q_down_proj (None without a query latent) and of
    # linear_kv_down_proj (kv_lora_rank + qk_pos_emb_head_dim); None without MLA.
    mla_down_rows: Optional[tuple[Optional[int], int]] = None

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def layers_per_chunk(self) -> int:
        return self.num_layers // (self.pp * self.chunks)

    def offset(self, pp_rank: int, vp_stage: int) -> int:
        """megatron-core's first global layer of a chunk (even split)."""
        return vp_stage * (self.num_layers // self.chunks) + pp_rank * self.layers_per_chunk


def _merge_tp(name: str, shards: list[Tensor], glu: bool,
              mla_down_rows: Optional[tuple] = None) -> Tensor:
    """One tensor from its TP shards (`name` without the layer prefix)."""
    if len(shards) == 1 or name in REPLICATED:
        return shards[0]
    if name in MLA_DOWN:
        full = mla_down_rows[MLA_DOWN.index(name)] if mla_down_rows else None
        if full is not None and all(s.shape[0] == full for s in shards):
            return shards[0]  # TE spec: duplicated
        if full is not None and sum(s.shape[0] for s in shards) == full:
            return torch.cat(shards, dim=0)  # local spec: column-parallel
        raise ValueError(f"{name}: TP shards of {[s.shape[0] for s in shards]} rows, "
                         f"neither whole nor a split of {full}")
    if name in COLUMN or (name in GLU and not glu):
        return torch.cat(shards, dim=0)
    if name in ROW:
        return torch.cat(shards, dim=1)
    if name in GLU:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ValueError(f"{name}: no known tensor-parallel layout")


def tp_shard_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape one of `tp` ranks holds of a tensor whose whole shape is `shape` (`name`
    without the layer prefix; experts as `mlp.linear_fc{1,2}.weight`): the split that
    _merge_tp undoes, from the same name sets. MLA's down projections, whose split
    depends on the spec, are a ValueError."""
    if tp == 1 or name in REPLICATED:
        return tuple(shape)
    dim = 0 if name in COLUMN or name in GLU else 1 if name in ROW else None
    if dim is None or shape[dim] % tp:
        raise ValueError(f"{name}: no known tensor-parallel split of {list(shape)} over {tp}")
    return tuple(s // tp if d == dim else s for d, s in enumerate(shape))


def _global_name(key: str, layout: LegacyLayout, offset: int) -> tuple[str, str]:
    """(the global key, the name without the layer prefix) of a chunk's key. MTP depths
    are numbered globally (all on the last stage: megatron-core's default placement)."""
    mtp = _MTP_LAYER.fullmatch(key)
    if mtp is not None:
        return f"mtp.layers.{mtp.group(1)}.transformer_layer.{mtp.group(2)}", mtp.group(2)
    own = _MTP_OWN.fullmatch(key)
    if own is not None:
        return key, own.group(2)
    m = _LAYER.fullmatch(key)
    if m is None:
        return key, key
    local = int(m.group(1))
    if local >= layout.layers_per_chunk:
        raise ValueError(f"{key}: a chunk holds {layout.layers_per_chunk} layers")
    return f"decoder.layers.{offset + local}.{m.group(2)}", m.group(2)


def _split_experts(sd: StateDict
                   ) -> tuple[StateDict, dict[tuple[str, int, int, str], Tensor]]:
    """(the non-expert tensors, {(kind, local layer or MTP depth, local expert, fc):
    tensor}), kind "decoder" or "mtp"."""
    dense, experts = {}, {}
    for key, t in sd.items():
        m, kind = _LAYER.fullmatch(key), "decoder"
        if m is None:
            m, kind = _MTP_LAYER.fullmatch(key), "mtp"
        e = _EXPERT.fullmatch(m.group(2)) if m else None
        if e is None:
            if m and m.group(2).startswith("mlp.experts."):
                raise ValueError(f"{key}: expert weights in a layout not supported yet "
                                 "(legacy GroupedMLP weight1/weight2?)")
            dense[key] = t
            continue
        i, fc = (e.group(1), e.group(2)) if e.group(1) is not None else (e.group(4), e.group(3))
        experts[(kind, int(m.group(1)), int(i), fc)] = t
    return dense, experts


def merge_chunk(files: dict[tuple[int, int], StateDict], layout: LegacyLayout, pp_rank: int,
                vp_stage: int) -> StateDict:
    """One pipeline chunk's global tensors. `files`: (tp, ep) -> that rank's state dict of
    this chunk (`_extra_state` dropped)."""
    offset = layout.offset(pp_rank, vp_stage)
    split = {k: _split_experts(sd) for k, sd in files.items()}
    dense_of = {t: split[min(k for k in split if k[0] == t)][0] for t in range(layout.tp)}
    names = sorted(dense_of[0])
    for t, sd in dense_of.items():
        if sorted(sd) != names:
            odd = sorted(set(sd) ^ set(names))[:3]
            raise ValueError(f"TP rank {t} holds other tensors than TP rank 0 ({odd})")
    out: StateDict = {}
    last = pp_rank == layout.pp - 1 and vp_stage == layout.chunks - 1
    for key in names:
        first = pp_rank == 0 and vp_stage == 0
        if key == "output_layer.weight" and layout.tied and not first:
            continue  # the last stage's copy of the (tied) word embeddings
        if key == "embedding.word_embeddings.weight" and not first:
            continue  # MTP's copy on the last stage (kept equal to the first stage's)
        name, short = _global_name(key, layout, offset)
        if (name == "output_layer.weight" or name.startswith("mtp.")) and not last:
            raise ValueError(f"{key} outside the last pipeline stage")
        out[name] = _merge_tp(short, [dense_of[t][key] for t in range(layout.tp)],
                              layout.swiglu, layout.mla_down_rows)
    local_e = layout.num_experts // layout.ep if layout.num_experts else 0
    for ep in range(layout.ep):
        expert_of = {t: split[min(k for k in split if k[1] == ep and (
            layout.etp == 1 or k[0] == t))][1] for t in range(layout.etp)}
        keys = sorted(expert_of[0])
        for t, experts in expert_of.items():
            if sorted(experts) != keys:
                raise ValueError(f"EP rank {ep}: expert TP rank {t} holds other experts "
                                 "than expert TP rank 0")
        for (kind, layer, i, fc) in keys:
            if i >= local_e:
                raise ValueError(f"layer {layer} expert {i}: an EP rank holds {local_e}")
            if kind == "decoder" and layer >= layout.layers_per_chunk:
                raise ValueError(f"layer {layer}: a chunk holds {layout.layers_per_chunk}")
            if kind == "mtp" and not last:
                raise ValueError(f"MTP depth {layer} outside the last pipeline stage")
            short = "mlp.linear_fc1.weight" if fc == "linear_fc1" else "mlp.linear_fc2.weight"
            where = (f"decoder.layers.{offset + layer}" if kind == "decoder"
                     else f"mtp.layers.{layer}.transformer_layer")
            name = f"{where}.mlp.experts.experts.{ep * local_e + i}.{fc}.weight"
            out[name] = _merge_tp(short, [expert_of[t][(kind, layer, i, fc)]
                                          for t in range(layout.etp)], layout.swiglu)
    return out


def merge_legacy(files: dict[tuple[int, int, int], list[StateDict]], layout: LegacyLayout
                 ) -> StateDict:
    """The whole model's megatron-core tensors from every rank's chunks: `files`
    (tp, pp, ep) -> [chunk 0's state dict, ...]."""
    out: StateDict = {}
    for pp in range(layout.pp):
        for v in range(layout.chunks):
            chunk = {(t, e): {k: x for k, x in sds[v].items() if "_extra_state" not in k}
                     for (t, p, e), sds in files.items() if p == pp}
            merged = merge_chunk(chunk, layout, pp, v)
            twice = set(merged) & set(out)
            if twice:
                raise ValueError(f"{sorted(twice)[0]} held by two pipeline chunks")
            out.update(merged)
    return out
