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

Modelled: TP 1, PP 1, CP 1, one optimizer instance, EP any (SequentialMLP experts,
`local_experts.N`), fp32 or bf16 parameters. Anything else raises NotModelled with the
reason (the converter then keeps weights and schedule only).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from checks import ConvertError
from megatron_dp_layout import Bucket, bucket_layout, bucket_size_of
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megamoe.training.checkpoint.megatron_common import load_megatron_pickle, read_byte_item

STATES = ("param", "exp_avg", "exp_avg_sq")
_BUCKET = re.compile(r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_"
                     r"(\d+)\.dtype_(\(torch\.\w+, torch\.\w+\))\.bucket_idx_(\d+)\.(\w+)")
_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


class NotModelled(Exception):
    """The saved args describe a layout this module does not rebuild; says why."""


def _int(args, name: str, default: int, low: int = 1) -> int:
    value = getattr(args, name, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConvertError(f"args.{name} = {value!r} is not an integer >= {low}")
    return value


def _flag(args, name: str) -> bool:
    value = getattr(args, name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConvertError(f"args.{name} = {value!r} is not a bool")
    return value


def _sizes(args) -> tuple[int, int]:
    """(data-parallel size, expert-parallel size), after refusing what is not modelled."""
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size", "num_distributed_optimizer_instances"):
        if _int(args, name, 1) != 1:
            raise NotModelled(f"args.{name} = {getattr(args, name)} (only 1 is modelled)")
    if getattr(args, "virtual_pipeline_model_parallel_size", None) not in (None, 1):
        raise NotModelled("virtual pipeline stages are not modelled")
    if _int(args, "expert_tensor_parallel_size", 1) != 1:
        raise NotModelled("args.expert_tensor_parallel_size != 1 is not modelled")
    for name in ("use_megatron_fsdp", "fp8_param_gather", "use_precision_aware_optimizer",
                 "moe_grouped_gemm"):
        if _flag(args, name):
            raise NotModelled(f"args.{name} is not modelled")
    if getattr(args, "ddp_num_buckets", None) is not None:  # (newer Megatron-LM)
        raise NotModelled("--ddp-num-buckets is not modelled")
    if not isinstance(getattr(args, "data_parallel_size", None), int):
        raise NotModelled("args.data_parallel_size is not saved")
    return _int(args, "data_parallel_size", 1), _int(args, "expert_model_parallel_size", 1)


Entry = tuple[str, tuple[int, ...]]  # (checkpoint key, index into its stacked dims)


def parameter_order(weights: dict[str, torch.Tensor], layers: int, experts: int, ep: int
                    ) -> tuple[list[Entry], list[list[Entry]]]:
    """(dense parameters, each EP rank's expert parameters), each in megatron-core's
    registration order (named_parameters), as (checkpoint key, index) entries.

    The checkpoint stacks every layer's tensor under one `decoder.layers.` key ([layers,
    ...]; experts [layers, experts, ...]) in the order the modules hold them; a model
    chunk registers layer after layer, each layer's parameters in that order and its
    SequentialMLP experts one after another (linear_fc1, linear_fc2 each). Expert rank r
    holds experts r*E..r*E+E-1 (E = experts / EP); with EP 1 they stay in the dense
    buffer."""
    keys = [k for k in weights if "_extra_state" not in k and not k.endswith("expert_bias")]
    stacked = [i for i, k in enumerate(keys) if k.startswith("decoder.layers.")]
    if not stacked or stacked != list(range(stacked[0], stacked[-1] + 1)):
        raise NotModelled("the layers are not saved as one stacked block")
    if any(not k.startswith(("embedding.", "decoder.", "output_layer.")) for k in keys):
        raise NotModelled("parameters outside embedding / decoder / output_layer (MTP?)")
    block = [keys[i] for i in stacked]
    expert_keys = [k for k in block if ".mlp.experts.experts." in k]
    if any(weights[k].dim() < 2 or weights[k].shape[0] != layers for k in block) or any(
            weights[k].dim() < 3 or weights[k].shape[1] != experts for k in expert_keys):
        raise NotModelled("stacked layer tensors of another shape (heterogeneous layers?)")
    if any(".experts." in k for k in block if k not in expert_keys):
        raise NotModelled("expert parameters not saved as `.mlp.experts.experts.`")
    local = experts // ep

    def expert_entries(i: int, rank: int) -> list[Entry]:
        return [(k, (i, rank * local + e)) for e in range(local) for k in expert_keys]

    dense: list[Entry] = [(k, ()) for k in keys[:stacked[0]]]
    for i in range(layers):
        for k in block:
            if k not in expert_keys:
                dense.append((k, (i,)))
            elif ep == 1 and k == expert_keys[0]:
                dense += expert_entries(i, 0)
    dense += [(k, ()) for k in keys[stacked[-1] + 1:]]
    ranks = [[e for i in range(layers) for e in expert_entries(i, r)] for r in range(ep)]
    return dense, ranks if ep > 1 else []


def expected_buffers(args, weights: dict[str, torch.Tensor]
                     ) -> dict[tuple[str, int], list[Bucket]]:
    """(key prefix, dp_group_idx) -> the buckets of that optimizer's one buffer."""
    dp, ep = _sizes(args)
    experts = _int(args, "num_experts", 1) if getattr(args, "num_experts", None) else 1
    if dp % ep or experts % ep:
        raise NotModelled(f"DP {dp} / EP {ep} / {experts} experts do not divide")
    dense, per_rank = parameter_order(weights, _int(args, "num_layers", 1), experts, ep)
    disable = _flag(args, "overlap_param_gather_with_optimizer_step")
    overlap, pad = _flag(args, "overlap_grad_reduce"), _flag(
        args, "ddp_pad_buckets_for_high_nccl_busbw")
    size = getattr(args, "ddp_bucket_size", None)
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConvertError(f"args.ddp_bucket_size = {size!r} is not a positive integer")
    bucket_size = bucket_size_of(overlap, size, dp, disable)

    def layout(entries: list[Entry], dp_size: int) -> list[Bucket]:
        return bucket_layout([(e, weights[e[0]][e[1]].numel()) for e in entries],
                             bucket_size, dp_size, pad)
    if ep == 1:
        return {("", 0): layout(dense, dp)}
    out = {("chained_0.", 0): layout(dense, dp)}
    out.update({("chained_1.", r): layout(names, dp // ep) for r, names in enumerate(per_rank)})
    return out


def _step_of(it_dir: str, metadata, prefixes: list[tuple[str, int]]) -> dict:
    """The optimizers' param_groups (their step counts) as megatron_optim's common part."""
    parts = {}
    for i, (prefix, idx) in enumerate(prefixes):
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


def _check_keys(found: dict[str, Any], want: dict[tuple[str, int], list[Bucket]]) -> str:
    """Every saved bucket tensor is one the rebuilt layout expects, at its length; returns
    the buffers' dtype key."""
    seen = set()
    for key, meta in found.items():
        m = _BUCKET.fullmatch(key)
        if m is None:
            continue
        prefix, idx, gbuf, bucket, state = (m.group(1) or "", int(m.group(2)), int(m.group(3)),
                                            int(m.group(5)), m.group(6))
        buckets = want.get((prefix, idx))
        if buckets is None or gbuf != 0 or bucket >= len(buckets) or state not in STATES:
            raise NotModelled(f"{key} is not a buffer of the layout the args describe")
        if not (isinstance(meta, TensorStorageMetadata) and len(meta.size) == 1
                and meta.properties.dtype.is_floating_point):
            raise ConvertError(f"{key} is not a flat float tensor")
        if meta.size[0] != buckets[bucket].numel_unpadded:
            raise NotModelled(f"{key} holds {meta.size[0]} elements, the layout rebuilt "
                              f"from the args {buckets[bucket].numel_unpadded}")
        seen.add((prefix, idx, bucket, state, m.group(4)))
    dtypes = {s[4] for s in seen}
    need = {(p, i, b, s) for (p, i), bs in want.items() for b in range(len(bs))
            for s in STATES}
    if len(dtypes) != 1 or {s[:4] for s in seen} != need:
        raise NotModelled("the saved buffers are not the ones the args describe "
                          f"({len(seen)} bucket states saved, {len(need)} expected)")
    return dtypes.pop()


def parameter_entries(want: dict[tuple[str, int], list[Bucket]]) -> list[Entry]:
    return [e for buckets in want.values() for b in buckets for e in b.params]


def read_flat_states(it_dir: str, common: dict, metadata, weights: dict[str, torch.Tensor],
                     load) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """({param, exp_avg, exp_avg_sq}: {Megatron model key: tensor shaped as the weight}, the
    optimizers' common part for megatron_optim's step check). `load(tensors)` fills the
    requested DCP tensors. NotModelled where the args do not rebuild the saved layout."""
    want = expected_buffers(common["args"], weights)
    dtype = _check_keys(metadata.state_dict_metadata, want)
    flat = {}
    for (prefix, idx), buckets in want.items():
        for b, bucket in enumerate(buckets):
            for state in STATES:
                key = (f"{prefix}optimizer.distributed.dp_group_idx_{idx}.gbuf_idx_0.dtype_"
                       f"{dtype}.bucket_idx_{b}.{state}")
                meta = metadata.state_dict_metadata[key]
                flat[key] = torch.empty(bucket.numel_unpadded, dtype=meta.properties.dtype)
    load(flat)
    out: dict[str, dict[str, torch.Tensor]] = {
        s: {k: torch.empty(weights[k].shape) for k, _ in parameter_entries(want)}
        for s in STATES}
    for (prefix, idx), buckets in want.items():
        for b, bucket in enumerate(buckets):
            for state in STATES:
                t = flat[f"{prefix}optimizer.distributed.dp_group_idx_{idx}.gbuf_idx_0.dtype_"
                         f"{dtype}.bucket_idx_{b}.{state}"]
                for (key, at), (start, end) in bucket.params.items():
                    out[state][key][at] = t[start:end].view(weights[key][at].shape)
    return out, _step_of(it_dir, metadata, list(want))
