"""The distributed optimizer's state of a legacy `--ckpt-format torch` checkpoint
(`distrib_optim.pt` beside each `model_optim_rng.pt`) -> Adam states per megatron-core
key, for megatron_optim's shared mapping and checks.

What Megatron-LM writes (megatron/training/checkpointing.py save_checkpoint; megatron-core
0.19 distrib_optimizer.py `save_parameter_state` / `get_parameter_state_dp_zero`,
optimizer.py ChainedOptimizer.save_parameter_state): every rank calls
`optimizer.save_parameter_state(mp_rank_*/distrib_optim.pt)`; each buffer is gathered on
its data-parallel rank 0, which writes

    {"buckets_coalesced": True,                      (gbuf_idx: the rank's model chunks)
     gbuf_idx: {(param dtype, grad dtype): {"param", "exp_avg", "exp_avg_sq": fp32 flat
                                            tensors, "numel_unpadded": int}}}

the flat tensors being the buffer's buckets, each without its end padding, one after
another (the same bucket layout as dp_reshardable: megatron_dp_layout). A
ChainedOptimizer (EP > 1: dense, then experts) writes a list with one such dict per
optimizer, None where this rank is not that optimizer's DP rank 0. The step count is in
`model_optim_rng.pt`'s `optimizer` (DistributedOptimizer.state_dict: the param_groups'
`step`; a list of those when chained).

Each rank's parameter list is its own model chunk's state dict (registration order,
local shapes, local names), so nothing is inferred from the whole tensors: the slices go
through megatron_dp_reshard.merge_buckets, the legacy weights' own merge. The layout
limits are megatron_dp_reshard's (NotModelled: weights and schedule only).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from checks import ConvertError
from megatron_dp_layout import bucket_layout, bucket_size_of
from megatron_dp_reshard import (
    STATES,
    NotModelled,
    _flag,
    _layout,
    merge_buckets,
    shared_embedding,
)
from megatron_optim import NAMES, step_of, to_megamoe_states

from megamoe.model.megatron_shards import merge_legacy
from megamoe.training.checkpoint.megatron_common import load_megatron_torch_file

FILE = "distrib_optim.pt"
Rank = tuple[int, int, int]


def _params(chunk: dict[str, torch.Tensor], experts: bool | None) -> list[tuple[str, tuple]]:
    """A chunk's parameters in registration order (state_dict order is named_parameters
    order; expert_bias is a buffer, `_extra_state` no tensor): all of them (None), the
    dense ones or the SequentialMLP experts' (EP > 1: two optimizers)."""
    return [(n, tuple(t.shape)) for n, t in chunk.items()
            if "_extra_state" not in n and not n.endswith("expert_bias")
            and (experts is None or (".local_experts." in n) == experts)]


def _buffer(obj: Any, index: int, chained: bool, path: str, gbufs: int = 1
            ) -> list[dict] | None:
    """One optimizer's buffers (gbuf_idx 0..gbufs-1: its rank's model chunks' in order),
    each {state: flat tensor, numel_unpadded}, of a distrib_optim.pt."""
    if chained:
        if not isinstance(obj, list) or len(obj) != 2:
            raise ConvertError(f"{path}: expected a list of 2 optimizers' states (EP > 1)")
        obj = obj[index]
        if obj is None:
            return None
    if not isinstance(obj, dict) or obj.get("buckets_coalesced") is not True:
        raise NotModelled(f"{path}: not megatron-core's coalesced-bucket format")
    found = sorted((k for k in obj if k != "buckets_coalesced"), key=str)
    if found != list(range(gbufs)):
        raise NotModelled(f"{path}: gradient buffers {found[:4]}, the model chunks "
                          f"{list(range(gbufs))} (mixed dtypes?)")
    return [_dtype_state(obj[g], g, path) for g in range(gbufs)]


def _dtype_state(by_dtype: Any, g: int, path: str) -> dict:
    """Buffer g's {state: flat tensor, numel_unpadded}, its fields checked."""
    if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
        raise ConvertError(f"{path}: buffer {g} is not one dtype's state")
    (state,) = by_dtype.values()
    if not isinstance(state, dict):
        raise ConvertError(f"{path}: buffer {g}'s state is not a dict")
    n = state.get("numel_unpadded")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= 2**48:
        raise ConvertError(f"{path}: numel_unpadded = {n!r} is not a positive integer")
    for name in STATES:
        t = state.get(name)
        if not (isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == n
                and t.dtype.is_floating_point):
            raise ConvertError(f"{path}: {name} is not a flat float tensor of "
                               f"numel_unpadded = {n} elements")
    return state


def _find(ranks: dict[Rank, tuple[str, Any]], want: list[Rank], index: int, chained: bool,
          gbufs: int) -> tuple[list[dict], str]:
    """The buffers that the files of `want` hold for optimizer `index` (written by its DP
    rank 0, whichever of those files that is)."""
    found = []
    for rank in want:
        path, obj = ranks[rank]
        state = _buffer(obj, index, chained, path, gbufs)
        if state is not None:
            found.append((state, path))
    if len(found) != 1:
        raise ConvertError(f"{ranks[want[0]][0]}: {len(found)} files of ranks {want} hold "
                           f"optimizer {index}'s buffer (expected exactly 1)")
    return found[0]


def read_legacy_distributed(it_dir: str, args,
                            chunks: dict[Rank, list[dict[str, torch.Tensor]]],
                            optimizers: dict[Rank, tuple[str, Any]]) -> tuple[dict, dict]:
    """({param, exp_avg, exp_avg_sq}: {megatron-core key: whole tensor}, the optimizers'
    common part for megatron_optim's step check). `chunks`: (tp, pp, ep) -> that rank
    file's model state dicts (`model`, or `model0`, `model1`, ... per virtual stage);
    `optimizers`: (its path, its `optimizer` entry). NotModelled where the args describe
    a layout not rebuilt."""
    layout, dp = _layout(args)
    size = getattr(args, "ddp_bucket_size", None)
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConvertError(f"args.ddp_bucket_size = {size!r} is not a positive integer")
    pad = _flag(args, "ddp_pad_buckets_for_high_nccl_busbw")
    first = bucket_size_of(_flag(args, "overlap_grad_reduce"), size, dp,
                           _flag(args, "overlap_param_gather_with_optimizer_step"))
    chained = layout.ep > 1
    files: dict[Rank, tuple[str, Any]] = {}
    for rank in chunks:
        path = os.path.join(os.path.dirname(optimizers[rank][0]), FILE)
        if not os.path.isfile(path):
            raise ConvertError(f"{path}: missing (the saved args say "
                               "--use-distributed-optimizer)")
        files[rank] = (path, load_megatron_torch_file(path))
    mtp = any(k.startswith("mtp.layers.") for sds in chunks.values() for sd in sds
              for k in sd)
    tied = shared_embedding(layout, mtp)
    pieces = []
    for p in range(layout.pp):
        groups = [(0, [(t, p, e) for e in range(layout.ep)], dp, False if chained else None)
                  for t in range(layout.tp)]
        if chained:
            edp = layout.tp * dp // (layout.etp * layout.ep)
            groups += [(1, [(t, p, e) for t in range(layout.tp)
                            if layout.etp == 1 or t == et], edp, True)
                       for e in range(layout.ep) for et in range(layout.etp)]
        for index, want, dp_size, experts in groups:
            want = [r for r in want if r in files]
            if any(len(chunks[r]) != layout.chunks for r in want):
                raise ConvertError(f"{files[want[0]][0]}: not {layout.chunks} model chunk(s)")
            # (Megatron-LM's get_model buckets only the first chunk; megatron-core's DDP
            # only the first stage; a chunk without such parameters has no buffer)
            layouts = [(v, buckets_of(_params(chunks[want[0]][v], experts),
                                      first if p == v == 0 else None, dp_size, pad, tied))
                       for v in range(layout.chunks)]
            layouts = [(v, b) for v, b in layouts if b]
            states, path = _find(files, want, index, chained, len(layouts))
            for (v, buckets), state in zip(layouts, states):
                if sum(b.numel_unpadded for b in buckets) != state["numel_unpadded"]:
                    raise NotModelled(f"{path}: {state['numel_unpadded']} elements in chunk "
                                      f"{v}'s buffer, the layout rebuilt from the args "
                                      f"{sum(b.numel_unpadded for b in buckets)}")
                offset = 0
                for bucket in buckets:
                    flat = {s: state[s][offset:offset + bucket.numel_unpadded]
                            for s in STATES}
                    pieces.append((bucket, want, v, flat))
                    offset += bucket.numel_unpadded
    # every file's optimizers' state_dicts (each the param_groups with their step)
    parts = [part for rank in sorted(optimizers) for part in (
        optimizers[rank][1] if chained and isinstance(optimizers[rank][1], list)
        else [optimizers[rank][1]])]
    return merge_buckets(pieces, layout, it_dir), {"optimizer": dict(enumerate(parts))}


def buckets_of(params: list[tuple[str, tuple]], size, dp_size: int, pad: bool,
               shared: frozenset[str]) -> list:
    """A chunk's buffer (bucket_layout) of its parameters (local name, local shape)."""
    new = frozenset(e for e in params if e[0] in shared)
    return bucket_layout([(e, math.prod(e[1])) for e in params], size, dp_size, pad, new)


def read_legacy_optimizer(it_dir: str, common: dict, ranks: dict[Rank, tuple[str, list, Any]],
                          config, params: dict) -> tuple[dict | None, int | None, str]:
    """(megamoe state name -> {parameter name: fp32 tensor}, the step, what was
    imported) of a legacy checkpoint, or (None, None, why not). `ranks`: (tp, pp, ep) ->
    (model_optim_rng.pt path, its model chunks, its `optimizer` entry)."""
    args = common["args"]
    if any(o is None for _, _, o in ranks.values()):
        return None, None, "the checkpoint holds no optimizer state (--no-save-optim?)"
    optimizer = getattr(args, "optimizer", "adam")
    if optimizer not in ("adam", None):
        return None, None, f"only Adam's state is read (args.optimizer = {optimizer!r})"
    distributed = getattr(args, "use_distributed_optimizer", False) is True
    try:
        raw, part = read_legacy_distributed(
            it_dir, args, {r: c for r, (_, c, _) in ranks.items()},
            {r: (path, o) for r, (path, _, o) in ranks.items()}) if distributed else (
            read_legacy_nondistributed(it_dir, args, ranks))
    except NotModelled as e:
        return None, None, f"the legacy optimizer's layout is not rebuilt: {e}"
    except ConvertError as e:
        msg = str(e)
        raise ConvertError(msg if msg.startswith(it_dir) else f"{it_dir} (args): {msg}"
                           ) from None
    step = step_of(part, it_dir)
    mapped = to_megamoe_states({NAMES[k]: v for k, v in raw.items()}, config, params, it_dir)
    where = FILE if distributed else "model_optim_rng.pt"
    kind = "the distributed optimizer" if distributed else "the non-distributed optimizer"
    return mapped, step, f"Adam state of {kind} ({where}) at step {step}"


def _wd_mult(name: str, shape: tuple, qk_ln_decays: bool) -> float:
    """megatron-core's standard override (get_standard_config_overrides): no weight
    decay for 1-D parameters and biases (with --apply-wd-to-qk-layernorm, except the
    q / k norms)."""
    skip = len(shape) == 1 or name.endswith(".bias")
    if qk_ln_decays and ("q_layernorm." in name or "k_layernorm." in name):
        skip = False
    return 0.0 if skip else 1.0


def _groups(entry: Any, path: str) -> tuple[dict, list | None]:
    """(the torch optimizer's state_dict, Float16's fp32_from_fp16_params or None) of
    one optimizer's state_dict (FP32Optimizer: the torch one; Float16OptimizerWith
    Float16Params: {optimizer, fp32_from_fp16_params, grad_scaler})."""
    if isinstance(entry, dict) and "fp32_from_fp16_params" in entry:
        inner, mains = entry.get("optimizer"), entry["fp32_from_fp16_params"]
        if not isinstance(mains, list):
            raise ConvertError(f"{path}: optimizer.fp32_from_fp16_params is not a list")
    else:
        inner, mains = entry, None
    if not (isinstance(inner, dict) and isinstance(inner.get("state"), dict)
            and isinstance(inner.get("param_groups"), list)):
        raise ConvertError(f"{path}: optimizer is not a torch optimizer state_dict")
    return inner, mains


def _rank_states(chunks: list[dict], entry: Any, args, experts: bool | None, path: str,
                 out: dict[str, list[dict[str, torch.Tensor]]], steps: set) -> None:
    """One optimizer's states of one rank file by chunk and local name into `out`.
    megatron-core's _get_param_groups orders the groups by their override (none, then
    wd_mult 0) and each group's parameters chunk after chunk (virtual stages), each
    chunk's in named_parameters order; torch numbers them across the groups (`params`
    index lists). Each saved group's wd_mult and is_expert_parallel pick its parameters;
    counts and every state's shape must match."""
    inner, mains = _groups(entry, path)
    params = [(v, n, shape) for v, chunk in enumerate(chunks)
              for n, shape in _params(chunk, experts)]
    qk = _flag(args, "apply_wd_to_qk_layernorm")
    used = set()
    for g, group in enumerate(inner["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise ConvertError(f"{path}: optimizer param_groups[{g}] has no params list")
        if group.get("is_decoupled_lr"):
            raise NotModelled("decoupled learning-rate groups are not modelled")
        wd, expert = group.get("wd_mult"), group.get("is_expert_parallel", False)
        if wd not in (0.0, 1.0) or group.get("lr_mult", 1.0) != 1.0:
            raise NotModelled(f"param group {g} with wd_mult {wd!r}, lr_mult "
                              f"{group.get('lr_mult')!r} (overrides) is not modelled")
        mine = [(v, n, shape) for v, n, shape in params if _wd_mult(n, shape, qk) == wd
                and (".local_experts." in n and experts is not None) == bool(expert)]
        if len(mine) != len(group["params"]) or mains is not None and (
                g >= len(mains) or not isinstance(mains[g], list)
                or len(mains[g]) != len(mine)):
            raise NotModelled(f"{path}: param group {g} holds {len(group['params'])} "
                              f"parameters, the model chunk {len(mine)} of its kind")
        for j, ((v, name, shape), idx) in enumerate(zip(mine, group["params"])):
            st = inner["state"].get(idx)
            tensors = {"exp_avg": st.get("exp_avg"), "exp_avg_sq": st.get("exp_avg_sq"),
                       "param": chunks[v][name] if mains is None else mains[g][j]
                       } if isinstance(st, dict) else {}
            for state, t in tensors.items():
                if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape
                        and t.dtype.is_floating_point):
                    raise ConvertError(f"{path}: optimizer state {idx} ({state}) is not a "
                                       f"float tensor shaped {list(shape)} like {name}")
                out[state][v][name] = t
            step = st.get("step")
            step = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
            if isinstance(step, bool) or not isinstance(step, (int, float)):
                raise ConvertError(f"{path}: optimizer state {idx} step {step!r} is not a "
                                   "number")
            steps.add(step)
            used.add((v, name))
    if used != {(v, n) for v, n, _ in params}:
        raise NotModelled(f"{path}: the param groups do not cover the chunk's parameters")


def read_legacy_nondistributed(it_dir: str, args, ranks: dict[Rank, tuple[str, list, Any]]
                               ) -> tuple[dict, dict]:
    """read_legacy_distributed for the non-distributed optimizers (FP32Optimizer,
    Float16OptimizerWithFloat16Params): each rank file's `optimizer` holds its own
    parameters' states (a list of the dense and the expert optimizer's with EP > 1), so
    every file gives a legacy-shaped state dict per state, merged as the weights are."""
    layout, _ = _layout(args)
    files: dict[str, dict[Rank, list[dict]]] = {s: {} for s in STATES}
    steps: set = set()
    for rank, (path, chunks, entry) in ranks.items():
        if len(chunks) != layout.chunks:
            raise ConvertError(f"{path}: not {layout.chunks} model chunk(s)")
        out: dict[str, list[dict[str, torch.Tensor]]] = {
            s: [{} for _ in chunks] for s in STATES}
        if layout.ep > 1:
            if not isinstance(entry, list) or len(entry) != 2:
                raise NotModelled(f"{path}: optimizer is not a list of the dense and the "
                                  "expert optimizer's states (EP > 1)")
            for part, experts in zip(entry, (False, True)):
                _rank_states(chunks, part, args, experts, path, out, steps)
        else:
            _rank_states(chunks, entry, args, None, path, out, steps)
        for s in STATES:
            files[s][rank] = out[s]
    try:
        merged = {s: merge_legacy(by_rank, layout) for s, by_rank in files.items()}
    except (ValueError, RuntimeError) as e:
        raise ConvertError(f"{it_dir}: the optimizer's rank states do not merge "
                           f"({e.args[0] if e.args else e})") from None
    return merged, {"optimizer": {i: {"state": {"common_step": v}}
                                  for i, v in enumerate(steps)}}
