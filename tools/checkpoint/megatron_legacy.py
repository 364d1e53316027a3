"""Reading Megatron-LM's legacy `--ckpt-format torch` iteration directories (convert.py
megatron-to-megamoe; megatron_format.py dispatches here when an iteration directory holds
`mp_rank_*` folders instead of DCP files).

Layout (Megatron-LM megatron/training/checkpointing.py, get_checkpoint_name):
`iter_{N:07d}/` or `release/` holding `mp_rank_{tp:02d}[_{pp:03d} if PP>1][_{ep:03d} if
EP>1]/model_optim_rng.pt`, one per (tp, pp, ep) rank written by a data-parallel or
expert-data-parallel rank 0, and `distrib_optim.pt` beside it with the distributed
optimizer. Each file is a torch.save'd dict: `args` (argparse.Namespace), `iteration`,
`checkpoint_version`, `model` (or `model0..` per virtual stage), `optimizer`,
`opt_param_scheduler`, `rng_state`, `num_floating_point_operations_so_far`.

Every file is unpickled by megatron_common's restricted unpickler; the layout comes from
rank 0's args and every other file must agree with it; a missing, stray or truncated rank
file is one error naming it. The weights are merged by megamoe/model/megatron_shards.py;
the optimizer state (each rank's `optimizer` entry, `distrib_optim.pt`) is read by
megatron_legacy_optim.py with the same merge.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

import torch
from checks import ConvertError

from megamoe.model.megatron_shards import LegacyLayout, merge_legacy
from megamoe.training.checkpoint.megatron_common import ForeignValue, load_megatron_torch_file

FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_\d{2}(?:_\d{3}){0,2}")
_MAX_SIZE = 2**16
_LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "expert_model_parallel_size", "expert_tensor_parallel_size",
                  "virtual_pipeline_model_parallel_size")


def is_legacy(it_dir: str) -> bool:
    return os.path.isdir(it_dir) and any(_RANK_DIR.fullmatch(n) for n in os.listdir(it_dir))


def rank_dir(tp: int, pp: int, ep: int, layout: LegacyLayout) -> str:
    """Megatron-LM's folder name of one rank's file (get_checkpoint_name)."""
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return name


def _size(ns: argparse.Namespace, name: str, where: str, default: Any = 1) -> Any:
    v = getattr(ns, name, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _MAX_SIZE:
        raise ConvertError(f"{where}: args.{name} = {v!r}: expected an integer in "
                           f"[1, {_MAX_SIZE}]")
    return v


def layout_of(ns: argparse.Namespace, where: str) -> LegacyLayout:
    """The parallel layout the saved args describe; uneven pipeline splits and an expert
    TP other than TP or 1 are refused (not supported yet)."""
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split"):
        if getattr(ns, name, None) not in (None, False):
            raise ConvertError(f"{where}: args.{name} = {getattr(ns, name)!r}: an uneven "
                               "pipeline split is not supported yet by the legacy reader")
    tp = _size(ns, "tensor_model_parallel_size", where)
    pp = _size(ns, "pipeline_model_parallel_size", where)
    vpp = _size(ns, "virtual_pipeline_model_parallel_size", where, None)
    ep = _size(ns, "expert_model_parallel_size", where)
    etp = _size(ns, "expert_tensor_parallel_size", where, tp)
    layers = _size(ns, "num_layers", where, None)
    experts = getattr(ns, "num_experts", None) or 0
    if layers is None:
        raise ConvertError(f"{where}: args.num_layers missing")
    if etp not in (tp, 1):
        raise ConvertError(f"{where}: args.expert_tensor_parallel_size = {etp} (TP {tp}): "
                           "not supported yet by the legacy reader (only TP or 1)")
    if layers % (pp * (vpp or 1)):
        raise ConvertError(f"{where}: args.num_layers = {layers} does not split evenly over "
                           f"PP {pp} x virtual stages {vpp or 1}")
    if experts and (not isinstance(experts, int) or isinstance(experts, bool)
                    or not 0 < experts <= 2**20 or experts % ep):
        raise ConvertError(f"{where}: args.num_experts = {experts!r} does not split over "
                           f"EP {ep}")
    down = None
    if getattr(ns, "multi_latent_attention", False) is True:  # MLA's down projections
        down = (_size(ns, "q_lora_rank", where, None),
                _size(ns, "kv_lora_rank", where) + _size(ns, "qk_pos_emb_head_dim", where))
    return LegacyLayout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, num_layers=layers,
                        num_experts=experts,  # gated fc1: --swiglu or --quick-geglu
                        swiglu=any(getattr(ns, f, False) is True
                                   for f in ("swiglu", "quick_geglu")),
                        tied=not getattr(ns, "untie_embeddings_and_output_weights", False),
                        mla_down_rows=down)


def _check_state(state: Any, path: str) -> dict:
    if not isinstance(state, dict) or not isinstance(state.get("args"), argparse.Namespace):
        raise ConvertError(f"{path}: not a Megatron-LM checkpoint (no `args` Namespace)")
    it = state.get("iteration", 0)
    if isinstance(it, bool) or not isinstance(it, int) or it < 0:
        raise ConvertError(f"{path}: iteration = {it!r} is not a non-negative integer")
    version = state.get("checkpoint_version", 0)
    if isinstance(version, bool) or not isinstance(version, (int, float)) or version < 3.0:
        raise ConvertError(f"{path}: checkpoint_version = {version!r}: only 3.0 (Megatron-LM "
                           "since 2020; older ones order the QKV rows differently) is read")
    return state


def _chunks(state: dict, layout: LegacyLayout, path: str) -> list[dict]:
    keys = ["model"] if layout.chunks == 1 else [f"model{v}" for v in range(layout.chunks)]
    out = []
    for key in keys:
        sd = state.get(key)
        if not isinstance(sd, dict):
            raise ConvertError(f"{path}: no `{key}` state dict (the saved args say "
                               f"{layout.chunks} virtual stage(s))")
        if any(isinstance(n, str) and n.startswith("language_model.") for n in sd):
            raise ConvertError(f"{path}: `{key}` holds the pre-megatron-core GPT's names "
                               "(language_model.*, megatron/legacy/model): not supported yet")
        for name, value in sd.items():
            extra = isinstance(name, str) and name.endswith("_extra_state")
            if not isinstance(name, str) or not (
                    isinstance(value, torch.Tensor) and value.is_floating_point()
                    or extra and (value is None or isinstance(value, (ForeignValue,
                                                                      torch.Tensor)))):
                raise ConvertError(f"{path}: {key}[{str(name)[:80]!r}] is not a floating "
                                   f"point tensor ({type(value).__name__})")
        out.append(sd)
    return out


def _rank0(it_dir: str) -> str:
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        if os.path.isdir(os.path.join(it_dir, name)):
            return os.path.join(it_dir, name, FILE)
    raise ConvertError(f"{it_dir}/mp_rank_00/{FILE}: missing (rank 0's file, which holds "
                       "the args)")


def _expected(it_dir: str, layout: LegacyLayout) -> dict[tuple[int, int, int], str]:
    """(tp, pp, ep) -> path of every rank file present; ConvertError naming a stray
    folder or the first file the layout needs that is missing."""
    names = {rank_dir(t, p, e, layout): (t, p, e) for t in range(layout.tp)
             for p in range(layout.pp) for e in range(layout.ep)}
    present = {n for n in os.listdir(it_dir) if _RANK_DIR.fullmatch(n)}
    stray = sorted(present - set(names))
    what = f"the saved args say TP {layout.tp} x PP {layout.pp} x EP {layout.ep}"
    if stray:
        raise ConvertError(f"{os.path.join(it_dir, stray[0])}: not a rank of this layout "
                           f"({what})")
    found = {r: os.path.join(it_dir, n, FILE) for n, r in names.items()
             if n in present and os.path.isfile(os.path.join(it_dir, n, FILE))}
    if layout.etp == layout.tp:  # every (tp, ep) pair holds its own expert shard
        for n, rank in sorted(names.items()):
            if rank not in found:
                raise ConvertError(f"{os.path.join(it_dir, n, FILE)}: missing ({what})")
        return found
    # expert TP 1 < TP: the dense and expert ranks fold differently; a stage needs each
    # TP rank and each EP rank in some file (Megatron-LM writes their union)
    pp = lambda p: f"_{p:03d}" if layout.pp > 1 else ""  # noqa: E731
    for p in range(layout.pp):
        for t in range(layout.tp):
            if not any(r[:2] == (t, p) for r in found):
                raise ConvertError(f"{it_dir}/mp_rank_{t:02d}{pp(p)}_*/{FILE}: missing "
                                   f"({what}, expert TP 1)")
        for e in range(layout.ep):
            if not any(r[1:] == (p, e) for r in found):
                raise ConvertError(f"{it_dir}/mp_rank_*{pp(p)}_{e:03d}/{FILE}: missing "
                                   f"({what}, expert TP 1)")
    return found


def read_megatron_legacy(it_dir: str) -> tuple[dict, dict, dict]:
    """(rank 0's state without its weights, the whole model's megatron-core tensors,
    (tp, pp, ep) -> (the rank file's path, its model chunks, its `optimizer` entry))."""
    first = _rank0(it_dir)
    state = _check_state(load_megatron_torch_file(first), first)
    layout = layout_of(state["args"], f"{first} (args)")
    paths = _expected(it_dir, layout)
    files, ranks = {}, {}
    for rank, path in sorted(paths.items()):
        other = state if path == first else _check_state(load_megatron_torch_file(path), path)
        for field in _LAYOUT_FIELDS + ("num_layers", "num_experts"):
            if getattr(other["args"], field, None) != getattr(state["args"], field, None):
                raise ConvertError(f"{path}: args.{field} differs from {first}'s (files of "
                                   "different runs?)")
        if other.get("iteration", 0) != state.get("iteration", 0):
            raise ConvertError(f"{path}: iteration {other.get('iteration')} differs from "
                               f"{first}'s {state.get('iteration')}")
        files[rank] = _chunks(other, layout, path)
        ranks[rank] = (path, files[rank], other.get("optimizer"))
    try:
        tensors = merge_legacy(files, layout)
    except (ValueError, RuntimeError) as e:
        raise ConvertError(f"{it_dir}: the rank files do not merge "
                           f"({e.args[0] if e.args else e})") from None
    common = {k: v for k, v in state.items()
              if k not in ("optimizer", "rng_state") and not k.startswith("model")}
    return common, tensors, ranks
