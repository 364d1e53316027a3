"""The distributed optimizer's `dp_reshardable` state (Megatron-LM's default layout) ->
Adam states per Megatron model key, for megatron_optim's shared mapping and checks.

megatron-core 0.19 (distrib_optimizer.py `sharded_param_state_dp_reshardable`) writes,
per distributed optimizer (a ChainedOptimizer's N-th with the prefix `chained_N.`),

    optimizer.distributed.dp_group_idx_{I}.gbuf_idx_{G}.dtype_({param}, {grad})
        .bucket_idx_{B}.{param,exp_avg,exp_avg_sq}

each a flat tensor of the bucket's unpadded length (the DP ranks' shards side by side;
the 64-element gaps between parameters hold garbage), and its param_groups (the step
count) as the byte item `optimizer.distributed.dp_group_idx_{I}.optimizer/shard_0_1`.
I is the rank in the tensor x pipeline group (dense) or in the expert tensor x expert x
pipeline group (experts). Each parameter's slice comes from megatron_dp_layout, rebuilt
from the saved args; every bucket's saved length must equal the rebuilt one, so a layout
that the args do not describe is not guessed at.

With virtual pipeline stages each model chunk has its own buffers (G = the chunk in
the rank's order; Megatron-LM buckets only the first chunk). Each (TP, PP) rank keeps its
own buffers: its TP slices of its stage's parameters
(dp_group_idx = tp + TP x pp, megatron-core's rank in the model-parallel group; the
expert buffers' dp_group_idx = etp + ETP x (ep + EP x pp)). Every rank's slices are cut
out as that rank's local tensors, named as a legacy rank file names them (layers
numbered in the stage, experts in the EP rank), and merged by megatron_shards.merge_legacy,
the legacy weights' own merge (column / row splits, SwiGLU's per-rank [gate; up]
halves, the qkv groups, stages renumbered).

Modelled: any TP, PP (even split, with or without virtual stages), DP, CP and EP with
expert TP = TP or 1 (EP > 1), one optimizer instance, SequentialMLP experts
(`local_experts.N`) or TEGroupedMLP's (--moe-grouped-gemm, expert TP 1:
megatron_grouped_experts), the TE spec's fused norms (megatron_te_order) or the local
spec's separate ones, the layers stacked (all alike) or one key per layer (dense and MoE
layers mixed), MTP on the last stage (at PP > 1 with untied embeddings), MLA (at TP > 1
the local spec's column-parallel down projections), MTP and MLA with --transformer-impl
local, fp32 or bf16 parameters.
Anything else raises NotModelled with the reason (the converter then keeps weights and
schedule only).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from checks import ConvertError
from megatron_dp_layout import Bucket, bucket_layout, bucket_size_of
from megatron_grouped_experts import te_grouped_experts, te_grouped_order
from megatron_te_order import module_path, own_order, te_dense_order
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megamoe.model.megatron_shards import MLA_DOWN, LegacyLayout, merge_legacy, tp_shard_shape
from megamoe.training.checkpoint.megatron_common import load_megatron_pickle, read_byte_item

STATES = ("param", "exp_avg", "exp_avg_sq")
_BUCKET = re.compile(r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_"
                     r"(\d+)\.dtype_(\(torch\.\w+, torch\.\w+\))\.bucket_idx_(\d+)\.(\w+)")


class NotModelled(Exception):
    """The saved args describe a layout this module does not rebuild; says why."""


def _int(args, name: str, default: int, low: int = 1, high: int = 2**20) -> int:
    """An untrusted integer field of the saved args, in [low, high]."""
    value = getattr(args, name, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConvertError(f"args.{name} = {value!r} is not an integer in [{low}, {high}]")
    return value


def _flag(args, name: str) -> bool:
    value = getattr(args, name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConvertError(f"args.{name} = {value!r} is not a bool")
    return value


_UNEVEN = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
           "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
           "account_for_loss_in_pipeline_split")


def _layout(args, grouped_experts: bool = False) -> tuple[LegacyLayout, int]:
    """(the parallel layout, the distributed optimizer's data-parallel size), after refusing
    what is not modelled. That size is DP x CP: megatron-core's DDP and optimizer shard
    over the intra_dp_cp group (context-parallel ranks hold the same parameters), so CP
    changes the bucket-end padding and default bucket size, not which parameters a
    buffer holds. grouped_experts: the caller reorders TEGroupedMLP's experts
    (megatron_grouped_experts), so --moe-grouped-gemm is not refused here."""
    if _int(args, "num_distributed_optimizer_instances", 1) != 1:
        raise NotModelled(f"args.num_distributed_optimizer_instances = "
                          f"{args.num_distributed_optimizer_instances} (only 1 is modelled)")
    cp = _int(args, "context_parallel_size", 1, high=2**16)
    for name in ("use_megatron_fsdp", "fp8_param_gather", "use_precision_aware_optimizer",
                 *(() if grouped_experts else ("moe_grouped_gemm",))):
        if _flag(args, name):
            raise NotModelled(f"args.{name} is not modelled")
    for name in _UNEVEN:
        if getattr(args, name, None) not in (None, False):
            raise NotModelled(f"args.{name} (an uneven pipeline split) is not modelled")
    if getattr(args, "ddp_num_buckets", None) is not None:  # (newer Megatron-LM)
        raise NotModelled("--ddp-num-buckets is not modelled")
    if not isinstance(getattr(args, "data_parallel_size", None), int):
        raise NotModelled("args.data_parallel_size is not saved")
    tp, pp = (_int(args, n, 1, high=2**16) for n in ("tensor_model_parallel_size",
                                                    "pipeline_model_parallel_size"))
    ep = _int(args, "expert_model_parallel_size", 1, high=2**16)
    etp = _int(args, "expert_tensor_parallel_size", tp, high=2**16)
    if etp not in ((tp, 1) if ep > 1 else (tp,)):
        raise NotModelled(f"expert TP {etp} with TP {tp}, EP {ep} is not modelled")
    experts = _int(args, "num_experts", 1) if getattr(args, "num_experts", None) else 0
    layers = _int(args, "num_layers", 1)
    vpp = _int(args, "virtual_pipeline_model_parallel_size", 1, high=2**16)
    dp = _int(args, "data_parallel_size", 1) * cp
    if layers % (pp * vpp) or (experts or ep) % ep or (tp * dp) % (etp * ep):
        raise NotModelled(f"{layers} layers / (PP {pp} x virtual stages {vpp}), {experts} "
                          f"experts / EP {ep}, TP {tp} x DP x CP {dp} / (expert TP {etp} x "
                          f"EP {ep}) do not divide")
    down = None
    if _flag(args, "multi_latent_attention"):
        impl = getattr(args, "transformer_impl", "transformer_engine")
        if tp > 1 and impl != "local":
            raise NotModelled(f"MLA with TP > 1 and --transformer-impl {impl!r} is not "
                              "modelled (only the local spec's column-parallel down "
                              "projections are checked against megatron-core)")
        q_rank = getattr(args, "q_lora_rank", None)
        down = (None if q_rank is None else _int(args, "q_lora_rank", 1),
                _int(args, "kv_lora_rank", 1) + _int(args, "qk_pos_emb_head_dim", 1))
    return LegacyLayout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp if vpp > 1 else None,
                        num_layers=layers,
                        num_experts=experts,  # gated fc1: --swiglu or --quick-geglu
                        swiglu=_flag(args, "swiglu") or _flag(args, "quick_geglu"),
                        tied=not _flag(args, "untie_embeddings_and_output_weights"),
                        mla_down_rows=down), dp


# (local name as a rank's state_dict names it, DCP key, index into its stacked dims,
#  the name the TP split rules know it by)
Param = tuple[str, str, tuple[int, ...], str]
# the same with the rank's local shape in place of the rule's name
Entry = tuple[str, str, tuple[int, ...], tuple[int, ...]]


_PER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# the local spec's fused-norm keys, by the module megatron-core registers them as
_NORM_MODULE = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def registration_order(rests: list[str], te: bool = False) -> list[str]:
    """A layer's keys (without the layer prefix) in megatron-core's named_parameters order:
    the saved order, except that a module's own parameters come before its submodules'
    (SharedExpertMLP's gate_weight before its linear_fc1 / linear_fc2, which its
    sharded_state_dict writes first); submodules in the order they first appear. te: the
    TE spec's fused norms (megatron_te_order), else the local spec's separate ones."""
    def order(names: list[tuple[list[str], str]]) -> list[str]:
        own = own_order([rest for path, rest in names if len(path) == 1], te)
        groups: dict[str, list[tuple[list[str], str]]] = {}
        for path, rest in names:
            if len(path) > 1:
                groups.setdefault(path[0], []).append((path[1:], rest))
        return own + [r for g in groups.values() for r in order(g)]
    return order([(module_path(r, te, _NORM_MODULE), r) for r in rests])


Layer = list[tuple[str, tuple[int, ...], str]]


def _layer_keys(weights: dict[str, torch.Tensor], keys: list[str], layout: LegacyLayout,
                te: bool) -> list[Layer]:
    """Every layer's [(key, index into its tensor, key without the layer prefix)]: the
    layers stacked under one `decoder.layers.` key ([layers, ...]; all
    layers alike) or one key per layer (`decoder.layers.{i}.`: layers of different kinds,
    such as a dense first layer)."""
    stacked = [k for k in keys if k.startswith("decoder.layers.")
               and not _PER_LAYER.fullmatch(k)]
    per_layer = [k for k in keys if _PER_LAYER.fullmatch(k)]
    if stacked and per_layer:
        raise NotModelled("layers saved both stacked and one key per layer")
    if stacked:
        if any(weights[k].dim() < 2 or weights[k].shape[0] != layout.num_layers
               for k in stacked):
            raise NotModelled("stacked layer tensors of another shape")
        rests = registration_order([k[len("decoder.layers."):] for k in stacked], te)
        return [[(f"decoder.layers.{r}", (i,), r) for r in rests]
                for i in range(layout.num_layers)]
    by_layer: dict[int, list[str]] = {}
    for k in per_layer:
        m = _PER_LAYER.fullmatch(k)
        by_layer.setdefault(int(m.group(1)), []).append(m.group(2))
    if sorted(by_layer) != list(range(layout.num_layers)):
        raise NotModelled(f"layers {sorted(by_layer)[:4]}.. saved, not 0..{layout.num_layers - 1}")
    return [[(f"decoder.layers.{i}.{r}", (), r) for r in registration_order(by_layer[i], te)]
            for i in range(layout.num_layers)]


def _mtp_depths(weights: dict[str, torch.Tensor], keys: list[str], experts: int
                ) -> list[Layer]:
    """Each MTP depth's [(key, (), key without `mtp.layers.{k}.`)] in registration order
    (enorm, hnorm, eh_proj, its transformer layer, final_layernorm: the saved order)."""
    by_depth: dict[int, list[str]] = {}
    for k in keys:
        m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", k)
        if m is None:
            raise NotModelled(f"{k}: not an MTP depth's key")
        by_depth.setdefault(int(m.group(1)), []).append(m.group(2))
    if sorted(by_depth) != list(range(len(by_depth))):
        raise NotModelled(f"MTP depths {sorted(by_depth)} saved")
    for depth, rests in by_depth.items():
        for r in rests:
            key = f"mtp.layers.{depth}.{r}"
            if ".experts." in r and not r.startswith("transformer_layer.mlp.experts.experts."):
                raise NotModelled("MTP expert parameters not saved as `.mlp.experts.experts.`")
            if r.startswith("transformer_layer.mlp.experts.") and (
                    weights[key].dim() < 2 or weights[key].shape[0] != experts):
                raise NotModelled(f"{key}: not {experts} experts")
    return [[(f"mtp.layers.{d}.{r}", (), r) for r in registration_order(by_depth[d])]
            for d in range(len(by_depth))]


def _add_layer(dense: list[Param], ranks: list[list[Param]], local: str, layer: Layer,
               inner: str, local_e: int) -> None:
    """One layer's parameters (`local`: its prefix in the rank's chunk; `inner`: the
    prefix of its transformer layer inside it, MTP's `transformer_layer.`) appended in
    registration order, its experts expanded where the first expert key is: to the dense
    buffer with EP 1, else each EP rank's experts to that rank's."""
    ep = len(ranks)
    head = f"{inner}mlp.experts."
    expert_keys = [(k, at) for k, at, rest in layer if rest.startswith(head)]
    for key, at, rest in layer:
        if not rest.startswith(head):
            dense.append((f"{local}{rest}", key, at, rest[len(inner):]
                          if rest.startswith(inner) else rest))
        elif key == expert_keys[0][0]:
            for r in range(ep):
                into = dense if ep == 1 else ranks[r]
                into += [(f"{local}{inner}mlp.experts.local_experts.{e}.{fc}.weight", ek,
                          (*eat, r * local_e + e), f"mlp.{fc}.weight")
                         for e in range(local_e) for ek, eat in expert_keys
                         for fc in [ek.split(".")[-2]]]


EMBEDDING = "embedding.word_embeddings.weight"


def stage_parameters(weights: dict[str, torch.Tensor], layout: LegacyLayout, pp_rank: int,
                     vp_stage: int = 0, te: bool = False
                     ) -> tuple[list[Param], list[list[Param]]]:
    """(a model chunk's dense parameters, each EP rank's expert parameters of the chunk),
    each in megatron-core's registration order (named_parameters). A chunk is a virtual
    stage of a pipeline rank (megatron_shards.LegacyLayout.offset: its layers).

    A chunk registers the word embeddings (the first chunk; with MTP and PP > 1 the last
    chunk's own copy too: GPTModel builds an embedding where MTP runs, kept equal to the
    first stage's by finalize_model_grads), its layers one after another (each layer's
    parameters in registration_order, its SequentialMLP experts one after another,
    linear_fc1, linear_fc2 each), then the final norm, MTP and the output layer (the
    last chunk; with tied embeddings and PP > 1 its own copy of the word embeddings).
    Expert rank r holds experts r*E..r*E+E-1 (E = experts / EP); with EP 1 they stay in
    the dense buffer."""
    keys = [k for k in weights if "_extra_state" not in k and not k.endswith("expert_bias")]
    if any(not k.startswith(("embedding.", "decoder.", "output_layer.", "mtp.layers."))
           for k in keys):
        raise NotModelled("parameters outside embedding / decoder / mtp / output_layer")
    layer_at = [i for i, k in enumerate(keys) if k.startswith("decoder.layers.")]
    if not layer_at or layer_at != list(range(layer_at[0], layer_at[-1] + 1)):
        raise NotModelled("the layers are not saved as one block")
    layers = _layer_keys(weights, [keys[i] for i in layer_at], layout, te)
    experts = max(layout.num_experts, 1)
    for key, at, rest in (x for layer in layers for x in layer):
        if ".experts." in rest and not rest.startswith("mlp.experts.experts."):
            raise NotModelled("expert parameters not saved as `.mlp.experts.experts.`")
        if rest.startswith("mlp.experts.experts.") and (
                weights[key].dim() < 2 + len(at) or weights[key].shape[len(at)] != experts):
            raise NotModelled(f"{key}: not {experts} experts")
    local_e, per = experts // layout.ep, layout.layers_per_chunk
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == layout.pp - 1 and vp_stage == layout.chunks - 1
    tail = keys[layer_at[-1] + 1:]
    mtp = [k for k in tail if k.startswith("mtp.layers.")]
    if mtp and layout.tied and layout.pp > 1:
        raise NotModelled("MTP with tied embeddings and PP > 1 is not modelled")
    dense: list[Param] = []
    if first:
        dense += [(k, k, (), k) for k in keys[:layer_at[0]]]
    elif last and mtp:  # (the MTP stage's embedding, registered first)
        dense.append((EMBEDDING, EMBEDDING, (), EMBEDDING))
    ranks: list[list[Param]] = [[] for _ in range(layout.ep)]
    start = layout.offset(pp_rank, vp_stage)
    for li, layer in enumerate(layers[start:start + per]):
        _add_layer(dense, ranks, f"decoder.layers.{li}.", layer, "", local_e)
    if last:
        final = [k for k in tail if k.startswith("decoder.")]
        output = [k for k in tail if k.startswith("output_layer.")]
        if tail != final + mtp + output:  # (GPTModel registers them in this order)
            raise NotModelled("the final norm, MTP and output layer saved in another order")
        dense += [(k, k, (), k) for k in final]
        for depth, layer in enumerate(_mtp_depths(weights, mtp, experts)):
            _add_layer(dense, ranks, f"mtp.layers.{depth}.", layer, "transformer_layer.",
                       local_e)
        dense += [(k, k, (), k) for k in output]
        if layout.tied and not first:
            dense.append(("output_layer.weight", EMBEDDING, (), "output_layer.weight"))
    return dense, ranks if layout.ep > 1 else []


def shared_embedding(layout: LegacyLayout, mtp: bool) -> frozenset[str]:
    """The local names megatron-core marks `shared_embedding` (a bucket of their own):
    with PP > 1, the first chunk's word embeddings and the last chunk's copy of them
    (tied embeddings: its output layer; MTP: its embedding), LanguageModule.
    setup_embeddings_and_output_layer."""
    if layout.pp == 1 or not (layout.tied or mtp):
        return frozenset()
    return frozenset({EMBEDDING, "output_layer.weight"} if layout.tied else {EMBEDDING})


def _shard_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """megatron_shards' rules, and MLA's down projections column-parallel: the local spec's
    (the only one _layout lets through at TP > 1)."""
    if tp > 1 and name in MLA_DOWN:
        if shape[0] % tp:
            raise ValueError(f"{name}: {shape[0]} rows do not split over TP {tp}")
        return (shape[0] // tp, *shape[1:])
    return tp_shard_shape(name, shape, tp)


def _on_rank(params: list[Param], weights: dict[str, torch.Tensor], tp: int) -> list[Entry]:
    """The parameters with the shapes one of `tp` ranks holds."""
    try:
        return [(local, key, at, _shard_shape(name, tuple(weights[key][at].shape), tp))
                for local, key, at, name in params]
    except ValueError as e:
        raise NotModelled(str(e)) from None


@dataclass
class RankBuffer:
    """One distributed optimizer's buffer (a model chunk's): its buckets, the (tp, pp, ep)
    legacy-file ranks its local tensors belong to, and the chunk (virtual stage)."""

    buckets: list[Bucket]
    files: list[tuple[int, int, int]]
    dp_size: int
    chunk: int = 0


def expected_buffers(args, weights: dict[str, torch.Tensor]
                     ) -> dict[tuple[str, int, int], RankBuffer]:
    """(key prefix, dp_group_idx, gbuf_idx) -> that optimizer's buffer, for every (TP,
    PP[, EP]) rank. An optimizer's buffers are its rank's model chunks' in order
    (gbuf_idx: megatron-core chains each chunk's DDP buffers; a chunk without expert
    parameters has no expert buffer)."""
    layout, dp = _layout(args, grouped_experts=True)
    grouped = te_grouped_experts(args, _flag, NotModelled, layout.etp)
    mtp = any(k.startswith("mtp.layers.") for k in weights)  # (MTP's every key)
    te = te_dense_order(args, _flag, NotModelled, mtp)
    disable = _flag(args, "overlap_param_gather_with_optimizer_step")
    overlap, pad = _flag(args, "overlap_grad_reduce"), _flag(
        args, "ddp_pad_buckets_for_high_nccl_busbw")
    size = getattr(args, "ddp_bucket_size", None)
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConvertError(f"args.ddp_bucket_size = {size!r} is not a positive integer")
    tp, ep, etp = layout.tp, layout.ep, layout.etp
    shared = shared_embedding(layout, mtp)
    out: dict[tuple[str, int, int], RankBuffer] = {}
    for p in range(layout.pp):
        for v in range(layout.chunks):
            dense, per_rank = stage_parameters(weights, layout, p, v, te)
            if grouped:
                dense = te_grouped_order(dense)
                per_rank = [te_grouped_order(r) for r in per_rank]
            # (Megatron-LM's get_model: bucketing only in the first chunk; megatron-core's
            # DDP: one bucket on every stage but the first)
            bucket_size = bucket_size_of(overlap, size, dp, disable) if p == v == 0 else None
            tied = frozenset(e for e in _on_rank(dense, weights, tp) if e[0] in shared)

            def buckets(params: list[Param], ranks: int, dp_size: int, new=frozenset(),
                        bucket_size=bucket_size) -> list[Bucket]:
                entries = _on_rank(params, weights, ranks)
                return bucket_layout([(e, math.prod(e[3])) for e in entries], bucket_size,
                                     dp_size, pad, new)
            for t in range(tp):
                files = [(t, p, e) for e in range(ep)]
                key = ("chained_0." if ep > 1 else "", t + tp * p)
                out[(*key, _next_gbuf(out, key))] = RankBuffer(buckets(dense, tp, dp, tied),
                                                               files, dp, v)
            for e, params in enumerate(per_rank):
                if not params:
                    continue
                for et in range(etp):
                    files = [(t, p, e) for t in range(tp) if etp == 1 or t == et]
                    key = ("chained_1.", et + etp * (e + ep * p))
                    edp = tp * dp // (etp * ep)
                    out[(*key, _next_gbuf(out, key))] = RankBuffer(
                        buckets(params, etp, edp), files, edp, v)
    return out


def _next_gbuf(out: dict[tuple[str, int, int], RankBuffer], key: tuple[str, int]) -> int:
    return sum(1 for k in out if k[:2] == key)


def _step_of(it_dir: str, metadata, prefixes: list[tuple[str, int]]) -> dict:
    """The optimizers' param_groups (their step counts) as megatron_optim's common part."""
    parts = {}
    for i, (prefix, idx) in enumerate(dict.fromkeys(prefixes)):
        fqn = f"{prefix}optimizer.distributed.dp_group_idx_{idx}.optimizer/shard_0_1"
        data, where = read_byte_item(it_dir, metadata.storage_data or {}, fqn)
        if data is None:
            raise ConvertError(f"{it_dir}: no {fqn} (the optimizer's param_groups)")
        obj = load_megatron_pickle(data, where)
        obj = obj[0] if isinstance(obj, list) and len(obj) == 1 else obj
        if not isinstance(obj, dict):
            raise ConvertError(f"{where}: {fqn} is not a dict")
        parts[i] = {"optimizer": obj}
    return {"optimizer": parts}


def _check_keys(found: dict[str, Any], want: dict[tuple[str, int, int], list[Bucket]]) -> str:
    """Every saved bucket tensor is one the rebuilt layout expects, at its length; returns
    the buffers' dtype key."""
    seen = set()
    for key, meta in found.items():
        m = _BUCKET.fullmatch(key)
        if m is None:
            continue
        prefix, idx, gbuf, bucket, state = (m.group(1) or "", int(m.group(2)), int(m.group(3)),
                                            int(m.group(5)), m.group(6))
        buckets = want.get((prefix, idx, gbuf))
        if buckets is None or bucket >= len(buckets) or state not in STATES:
            raise NotModelled(f"{key} is not a buffer of the layout the args describe")
        if not (isinstance(meta, TensorStorageMetadata) and len(meta.size) == 1
                and meta.properties.dtype.is_floating_point):
            raise ConvertError(f"{key} is not a flat float tensor")
        if meta.size[0] != buckets[bucket].numel_unpadded:
            raise NotModelled(f"{key} holds {meta.size[0]} elements, the layout rebuilt "
                              f"from the args {buckets[bucket].numel_unpadded}")
        seen.add((prefix, idx, gbuf, bucket, state, m.group(4)))
    dtypes = {s[5] for s in seen}
    need = {(p, i, g, b, s) for (p, i, g), bs in want.items() for b in range(len(bs))
            for s in STATES}
    if len(dtypes) != 1 or {s[:5] for s in seen} != need:
        raise NotModelled("the saved buffers are not the ones the args describe "
                          f"({len(seen)} bucket states saved, {len(need)} expected)")
    return dtypes.pop()


def read_flat_states(it_dir: str, common: dict, metadata, weights: dict[str, torch.Tensor],
                     load) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """({param, exp_avg, exp_avg_sq}: {megatron-core key (per layer, per expert): tensor
    shaped as the weight}, the optimizers' common part for megatron_optim's step check).
    `load(tensors)` fills the requested DCP tensors. NotModelled where the args do not
    rebuild the saved layout."""
    want = expected_buffers(common["args"], weights)
    layout, _ = _layout(common["args"], grouped_experts=True)
    dtype = _check_keys(metadata.state_dict_metadata, {k: b.buckets for k, b in want.items()})

    def fqn(prefix: str, idx: int, g: int, b: int, state: str) -> str:
        return (f"{prefix}optimizer.distributed.dp_group_idx_{idx}.gbuf_idx_{g}.dtype_"
                f"{dtype}.bucket_idx_{b}.{state}")
    meta = metadata.state_dict_metadata
    flat = {fqn(*k, b, s): torch.empty(bucket.numel_unpadded,
                                       dtype=meta[fqn(*k, b, s)].properties.dtype)
            for k, buf in want.items() for b, bucket in enumerate(buf.buckets) for s in STATES}
    load(flat)
    pieces = [(bucket, buf.files, buf.chunk, {s: flat[fqn(*k, b, s)] for s in STATES})
              for k, buf in want.items() for b, bucket in enumerate(buf.buckets)]
    return merge_buckets(pieces, layout, it_dir), _step_of(it_dir, metadata,
                                                           [k[:2] for k in want])


def merge_buckets(pieces: list[tuple[Bucket, list[tuple[int, int, int]], int,
                                     dict[str, torch.Tensor]]],
                  layout: LegacyLayout, where: str) -> dict[str, dict[str, torch.Tensor]]:
    """Every bucket's states (bucket, the (tp, pp, ep) ranks it belongs to, its model
    chunk, {state: its flat tensor}) cut into each rank's local tensors, named as its
    legacy rank file names them in that chunk (bucket_layout's entries: (local name, ...,
    local shape)), then merged into whole megatron-core tensors by the legacy weights'
    own merge."""
    files: dict[str, dict[tuple[int, int, int], list[dict[str, torch.Tensor]]]] = {
        s: {} for s in STATES}
    for bucket, ranks, chunk, flat in pieces:
        for state, t in flat.items():
            for entry, (start, end) in bucket.params.items():
                for rank in ranks:
                    chunks = files[state].setdefault(rank, [{} for _ in range(layout.chunks)])
                    chunks[chunk][entry[0]] = t[start:end].view(entry[-1])
    try:
        return {s: merge_legacy(by_rank, layout) for s, by_rank in files.items()}
    except (ValueError, RuntimeError) as e:
        raise ConvertError(f"{where}: the optimizer's rank buffers do not merge "
                           f"({e.args[0] if e.args else e})") from None
