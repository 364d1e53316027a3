"""--ckpt-format torch_dist: sharded checkpoints on torch.distributed.checkpoint (DCP) that
load into any parallel layout.

    SAVE/iter_0000100/__0_0.distcp ...   every rank's shards (DCP), replicas written once
    SAVE/iter_0000100/.metadata          DCP's index: key -> global shape, chunks
    SAVE/iter_0000100/common.pt          rank 0: iteration, consumed samples, args, model
                                         config, LR scheduler, optimizer step, RNG states
    SAVE/latest_checkpointed_iteration.txt

Tensor keys are layout-free (sharded_state.py): `model.<single-process name>[.part]` and
`optimizer.<same>.{main,exp_avg,exp_avg_sq,momentum_buffer}`. With the distributed
optimizer each parameter's weights and whole states are written by one rank of its dp /
edp group (the one holding its first element; a parameter crossing that rank's shard end
is assembled there, one at a time) and re-sliced at load from what each rank's pieces
need, so the optimizer state loads under any dp size too, and no rank holds more than its
own part of the states at save.

RNG: each rank's states are saved; a run with the same world size and layout restores its
own rank's; under any other layout pretrain reseeds from --seed + iteration (+ the
pipeline stage's offset), since resharding changes the dropout streams anyway, and says so.

Publish protocol: the same as the single-file format (publish.py): rank 0 prepares
`iter_N.tmp.PID`, every rank writes into it, rank 0 adds common.pt, all ranks barrier,
rank 0 publishes by rename, then the pointer. --async-save: DCP writes on a background
thread; the next save or the end of training publishes. DCP's planner: save_planner.py.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from megamoe.config import ModelConfig
from megamoe.model.fp8.params import value
from megamoe.model.gpt_model import GPTModel
from megamoe.training.checkpoint.config_check import check_model_config
from megamoe.training.checkpoint.fields import check_fields
from megamoe.training.checkpoint.fp8_state import gather_fp8_states, restore_fp8_state
from megamoe.training.checkpoint.publish import (
    COMMON,
    KeepLast,
    agree,
    dcp_failure,
    discard_tmp,
    failure_message,
    fsync_dir,
    pause_point,
    prepare_tmp,
    publish_tmp,
    save_torch_file,
)
from megamoe.training.checkpoint.rng_state import rng_state, set_rng_state
from megamoe.training.checkpoint.safe_load import (
    CheckpointError,
    SafeFileSystemReader,
    TensorOnlyLoadPlanner,
    load_torch_file,
    read_dcp_metadata,
)
from megamoe.training.checkpoint.sharded_state import Entry, model_entries
from megamoe.training.checkpoint.snapshot import snapshot
from megamoe.training.checkpoint.strictness import KeyMismatch
from megamoe.training.checkpoint.te_state import gather_te_states, restore_te_state

FORMAT_VERSION = 1


def _world(single: bool = False) -> tuple[int, int]:
    if not single and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _cause(e: BaseException) -> str:
    """The first rank's underlying error of a DCP failure (a truncated shard: EOFError)."""
    _, e = dcp_failure(e)
    text = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {text[0][:160]}" if text else e.__class__.__name__


# Without a process group DCP warns that it assumes one process (also from async saves
# writer threads): that is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized")


def _param_keys(optimizer, entries: list[Entry]) -> list[Optional[Entry]]:
    """The model entry of each optimizer parameter (aligned with optimizer.model_params)."""
    by_id = {id(e.tensor): e for e in entries}
    return [by_id.get(id(p)) for p in optimizer.model_params]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A private host copy of `t` (a DTensor: its local shard), exactly its size (a view
    copies only the view): async saves' staging, which the writer reads while training."""
    return t.to(device="cpu", copy=True)


def _tensor_state(model: nn.Module, optimizer, mesh, world: int, save_optim: bool,
                  copy: bool) -> tuple[dict[str, Any], Optional[dict]]:
    """{key: DTensor | tensor} of the tensors this rank saves: views of its shards, or
    (`copy`: async saves) one host copy of each. With the distributed optimizer each
    parameter and its states are offered by one rank of its shard group only
    (`optimizer.saves_param`), the others by every replica (DCP writes them once)."""
    entries = model_entries(model, mesh if world > 1 else None)
    index = {} if optimizer is None else {id(p): i for i, p in
                                          enumerate(optimizer.model_params)}
    state: dict[str, Any] = {}

    def put(key: str, part, t: torch.Tensor) -> None:
        # No .contiguous() (DCP copies a view item by item); FP8 weights: dequantised.
        wrapped = part.wrap(part.local(value(t).detach()))
        state[key] = _host_copy(wrapped) if copy else wrapped

    for e in entries:
        i = index.get(id(e.tensor))
        if e.save and (i is None or optimizer.saves_param(i)):
            for part in e.parts:
                put(f"model.{part.key}", part, e.tensor)
    if not save_optim or optimizer is None:
        return state, None
    states, step, names = optimizer.param_states()  # collective for the distributed one
    for e, st in zip(_param_keys(optimizer, entries), states):
        if e is not None and e.save and st is not None:
            for name, t in st.items():
                for part in e.parts:
                    put(f"optimizer.{part.key}.{name}", part, t)
    scaler = getattr(optimizer, "grad_scaler", None)  # --fp16: Megatron's grad_scaler
    return state, {"step": step, "names": sorted(names),
                   **({"grad_scaler": scaler.state_dict()} if scaler is not None else {})}


class _AlreadyStaged(AsyncStager):
    """dcp.async_save's stager for a state dict of host copies (_tensor_state(copy=True)):
    DCP's default stager would copy every tensor's whole storage once more."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    close = synchronize_staging


def _common(iteration: int, consumed_samples: int, args: dict, model_config, scheduler,
            optim_common, save_rng: bool, mesh, rank: int, world: int, extra) -> dict:
    """Rank 0's non-tensor state (None on other ranks); gathers every rank's RNG states."""
    rngs = [rng_state()] if save_rng else None
    if save_rng and world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(rngs[0], gathered, dst=0)
        rngs = gathered
    if rank != 0:
        return None
    return {"format": "torch_dist", "format_version": FORMAT_VERSION, "iteration": iteration,
            "consumed_train_samples": consumed_samples, "args": args,
            "model_config": model_config,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "optimizer": optim_common, "rng": rngs, "world_size": world,
            "layout": dict(getattr(mesh, "sizes", {}) or {}), **(extra or {})}


def _agreed(phase: Callable[[], Any], root: str, iteration: int, tmp: Optional[str],
            rank: int, world: int) -> Any:
    """Run one phase of a save on this rank, then learn every rank's outcome (a collective,
    also the phase's barrier). If any rank failed (an OSError, or DCP's report of one on
    any rank), rank 0 removes the temporary directory and every rank raises the same
    CheckpointError naming the --save directory: no rank is left waiting for another."""
    result, error, cause = None, None, None
    try:
        result = phase()
    except (Exception, CheckpointException) as e:
        if not isinstance(e, (OSError, CheckpointException)):
            cause = e  # not a storage failure: a bug, its traceback is kept
        error = failure_message(root, iteration, e, rank, world)
    error = agree(error, world)
    if error is not None:
        if rank == 0:
            discard_tmp(tmp)
        if cause is not None:
            raise cause
        raise CheckpointError(error)
    return result


def _prepare(root: str, iteration: int, rank: int, world: int) -> str:
    """Rank 0 makes the tmp directory; every rank learns its name."""
    tmp = _agreed(lambda: prepare_tmp(root, iteration) if rank == 0 else None,
                  root, iteration, None, rank, world)
    if world > 1:
        box = [tmp]
        dist.broadcast_object_list(box, src=0)
        tmp = box[0]
    if rank == 0:
        pause_point("before_write", iteration)
    return tmp


def _write_common(tmp: str, common: Optional[dict], rank: int) -> None:
    if rank == 0:
        save_torch_file(common, os.path.join(tmp, COMMON))
        fsync_dir(tmp)


def _finish(root: str, iteration: int, tmp: str, common: Optional[dict],
            keep_last: KeepLast, rank: int, world: int) -> str:
    """After every rank's shards are written: common.pt, agree, publish, agree."""
    _agreed(lambda: _write_common(tmp, common, rank), root, iteration, tmp, rank, world)

    def publish() -> str:
        if rank != 0:
            return tmp
        pause_point("after_write", iteration)
        return publish_tmp(root, iteration, tmp, keep_last)

    return _agreed(publish, root, iteration, tmp, rank, world)


def save_dist_checkpoint(root: str, iteration: int, model: nn.Module, optimizer, scheduler,
                         mesh, consumed_samples: int, args: dict, *, planner=None,
                         model_config: Optional[dict] = None, save_optim: bool = True,
                         save_rng: bool = True, keep_last: KeepLast = None,
                         extra: Optional[dict] = None, single: bool = False) -> str:
    """Collective: every rank calls it (`single`: a single-process model, this process
    alone), `planner` from save_planner.py. Returns the published directory."""
    rank, world = _world(single)
    state, optim_common = _tensor_state(model, optimizer, mesh, world, save_optim, copy=False)
    fp8 = gather_fp8_states(model, rank, world)
    extra = {**(extra or {}), **({"fp8": fp8} if fp8 is not None else {}),
             **gather_te_states(model, rank, world)}
    common = _common(iteration, consumed_samples, args, model_config, scheduler, optim_common,
                     save_rng, mesh, rank, world, extra)
    tmp = _prepare(root, iteration, rank, world)
    # A failed write on any rank reaches every rank through DCP's own collectives.
    _agreed(lambda: dcp.save(state, checkpoint_id=tmp, no_dist=world == 1, planner=planner),
            root, iteration, tmp, rank, world)
    return _finish(root, iteration, tmp, common, keep_last, rank, world)


class AsyncDistSaver:
    """--async-save with torch_dist: the tensors this rank saves are copied once into host
    memory on the training thread (nothing is cloned on the device), then DCP
    writes them on a background thread (its collectives on a gloo group of their own)
    while training continues. The checkpoint is published (common.pt, rename, pointer) by
    `finalize`, which the next save and the end of training call on every rank."""

    def __init__(self) -> None:
        self.rank, self.world = _world()
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self._pending: Optional[tuple] = None

    def save(self, root: str, iteration: int, model: nn.Module, optimizer, scheduler, mesh,
             consumed_samples: int, args: dict, *, model_config: Optional[dict] = None,
             save_optim: bool = True, save_rng: bool = True,
             keep_last: KeepLast = None, planner=None) -> None:
        self.finalize()
        state, optim_common = _tensor_state(model, optimizer, mesh, self.world, save_optim,
                                            copy=True)
        # written by finalize(), after later steps: this iteration's values (snapshot.py)
        fp8 = gather_fp8_states(model, self.rank, self.world)  # host copies: a snapshot
        extra = {**({"fp8": fp8} if fp8 is not None else {}),
                 **gather_te_states(model, self.rank, self.world)}
        common = snapshot(_common(iteration, consumed_samples, args, model_config, scheduler,
                                  optim_common, save_rng, mesh, self.rank, self.world,
                                  extra or None))
        tmp = _prepare(root, iteration, self.rank, self.world)
        future = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group,
                                no_dist=self.world == 1, async_stager=_AlreadyStaged(),
                                planner=planner)
        self._pending = (future, root, iteration, tmp, common, keep_last)

    def finalize(self) -> None:
        """Wait for the in-flight save and publish it (collective); CheckpointError if the
        write failed."""
        if self._pending is None:
            return
        future, root, iteration, tmp, common, keep_last = self._pending
        self._pending = None
        _agreed(future.result, root, iteration, tmp, self.rank, self.world)
        _finish(root, iteration, tmp, common, keep_last, self.rank, self.world)


def read_common(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, COMMON)
    try:
        common = load_torch_file(path)  # megamoe's own types only (safe_load.py)
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir}: missing {COMMON}") from None
    if not isinstance(common, dict) or common.get("format") != "torch_dist":
        raise CheckpointError(f"{path}: not a megamoe torch_dist checkpoint")
    return check_fields(path, common, dist=True)


def read_metadata(ckpt_dir: str) -> dict[str, Any]:
    """DCP's index of `ckpt_dir`: {key: TensorStorageMetadata (size, dtype) | bytes}, read
    by the restricted unpickler (a crafted .metadata cannot run code)."""
    return read_dcp_metadata(os.path.join(ckpt_dir, ".metadata")).state_dict_metadata


def _dcp_load(state: dict[str, Any], ckpt_dir: str, no_dist: bool) -> None:
    """dcp.load of tensors only, through the safe reader and planner (safe_load.py)."""
    try:
        dcp.load(state, checkpoint_id=ckpt_dir, no_dist=no_dist,
                 storage_reader=SafeFileSystemReader(ckpt_dir),
                 planner=TensorOnlyLoadPlanner())
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{ckpt_dir}: cannot be read ({_cause(e)})") from None


def _request(meta: dict, ckpt_dir: str, key: str, part, like: torch.Tensor,
             request: dict, targets: list, target: Callable[[torch.Tensor], None]) -> None:
    """Ask DCP for `key` into a fresh buffer; `target(buffer)` consumes it after the load."""
    if key not in meta:
        raise CheckpointError(f"{ckpt_dir}: does not match the model (missing {key})")
    if not isinstance(meta[key], TensorStorageMetadata):
        raise CheckpointError(f"{ckpt_dir}: does not match the model ({key} is not a tensor "
                              "in the checkpoint)")
    saved = tuple(meta[key].size)
    if saved != part.global_shape:
        raise CheckpointError(f"{ckpt_dir}: does not match the model ({key} has shape "
                              f"{list(saved)} in the checkpoint, {list(part.global_shape)} "
                              "in this model)")
    if key not in request:
        # On the target's device: DTensor.from_local would copy a buffer from another device
        # onto the mesh's, DCP would fill that copy, and the buffer read back would be the
        # never-written original (every sharded tensor silently garbage on a GPU run).
        buf = torch.empty(part.local(like).shape, dtype=like.dtype, device=like.device)
        wrapped = part.wrap(buf)
        local = wrapped.to_local() if isinstance(wrapped, DTensor) else wrapped
        if local.data_ptr() != buf.data_ptr():
            raise RuntimeError(f"{key}: the load buffer on {buf.device} was copied to "
                               f"{local.device}; the checkpoint would load into the copy")
        request[key] = (wrapped, buf)
    targets.append((request[key][1], target))


def _request_part(meta: dict, ckpt_dir: str, prefix: str, suffix: str, part, like: torch.Tensor,
                  request: dict, targets: list, target: Callable[[torch.Tensor], None]) -> None:
    """`_request` of `prefix + part.key + suffix`, or, for a part of a tensor that older
    checkpoints hold whole (`part.whole_key`: the shared experts before they were split
    over TP), of that whole tensor, read entirely and sliced to this rank's region."""
    key, whole = f"{prefix}{part.key}{suffix}", f"{prefix}{part.whole_key}{suffix}"
    if key in meta or part.whole_key is None or whole not in meta:
        _request(meta, ckpt_dir, key, part, like, request, targets, target)
        return
    saved = tuple(meta[whole].size)
    rows = part.global_shape[0]
    if saved[1:] != part.global_shape[1:] or saved[0] < part.whole_row + rows:
        raise CheckpointError(f"{ckpt_dir}: does not match the model ({whole} has shape "
                              f"{list(saved)} in the checkpoint, which holds no rows "
                              f"{part.whole_row}:{part.whole_row + rows} of shape "
                              f"{list(part.global_shape)})")
    if whole not in request:
        buf = torch.empty(saved, dtype=like.dtype, device=like.device)
        request[whole] = (buf, buf)
    local_shape = tuple(part.local(like).shape)
    offsets = part.global_offsets(local_shape)

    def mine(buf: torch.Tensor) -> torch.Tensor:
        region = buf.narrow(0, part.whole_row, rows)
        for d, (start, n) in enumerate(zip(offsets, local_shape)):
            region = region.narrow(d, start, n)
        return region

    targets.append((request[whole][1], lambda buf: target(mine(buf))))


def _in_checkpoint(meta: dict, prefix: str, part, suffix: str) -> bool:
    return (f"{prefix}{part.key}{suffix}" in meta or part.whole_key is not None
            and f"{prefix}{part.whole_key}{suffix}" in meta)


def load_dist_checkpoint(ckpt_dir: str, model: nn.Module, optimizer, scheduler, mesh, *,
                         load_optim: bool = True, load_rng: bool = True,
                         finetune: bool = False, common: Optional[dict] = None,
                         single: bool = False,
                         strictness: str = "assume_ok_unexpected") -> dict:
    """Load `ckpt_dir` (an iter_N directory) into this rank's shards (collective; `single`:
    a single-process model in this process alone). Returns the common state; its
    "rng_restored" says whether this rank's RNG states were set, its "key_mismatch" the
    model keys --dist-ckpt-strictness let pass (strictness.py). FP8 primary weights
    (--fp8-param-gather) load inside optim/fp8_shards.fp8_weights_loading."""
    rank, world = _world(single)
    common = read_common(ckpt_dir) if common is None else common
    check_model_config(ckpt_dir, common.get("model_config"), getattr(model, "config", None))
    meta = read_metadata(ckpt_dir)
    entries = model_entries(model, mesh if world > 1 else None)
    request: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    targets: list = []
    mismatch = KeyMismatch(strictness, ckpt_dir)
    for e in entries:
        for part in e.parts:
            if (not _in_checkpoint(meta, "model.", part, "")
                    and mismatch.tolerate_absent(f"model.{part.key}")):
                continue
            _request_part(meta, ckpt_dir, "model.", "", part, e.tensor, request, targets,
                          lambda buf, t=e.tensor, p=part: p.local(t).copy_(buf))
    mismatch.check_missing(meta, [k for k in request if k.startswith("model.")],
                           distributed=world > 1)
    optim = common.get("optimizer")
    use_optim = (optimizer is not None and load_optim and not finetune and optim is not None)
    per_param: list[dict[str, torch.Tensor]] = []
    if use_optim:
        for i, (e, p) in enumerate(zip(_param_keys(optimizer, entries),
                                       optimizer.model_params)):
            st: dict[str, torch.Tensor] = {}
            per_param.append(st)
            if not optimizer.loads_param(i):  # the distributed optimizer: no piece here
                continue
            for name in optim["names"]:
                if name == "main" and not _in_checkpoint(meta, "optimizer.", e.parts[0],
                                                         ".main"):
                    continue
                full = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                st[name] = full
                for part in e.parts:
                    _request_part(meta, ckpt_dir, "optimizer.", f".{name}", part, full,
                                  request, targets,
                                  lambda buf, t=full, q=part: q.local(t).copy_(buf))
    _dcp_load({k: v[0] for k, v in request.items()}, ckpt_dir, no_dist=world == 1)
    with torch.no_grad():
        for buf, target in targets:
            target(buf)
    common["key_mismatch"] = mismatch.report()
    if optimizer is not None:
        if use_optim:
            optimizer.load_param_states(per_param, optim.get("step"))
            optimizer.load_grad_scaler_state(optim.get("grad_scaler"))
        else:
            optimizer.reload_model_params()
    common["rng_restored"] = False
    if not finetune:
        if scheduler is not None and load_optim and common.get("scheduler") is not None:
            scheduler.load_state_dict(common["scheduler"])
        rngs = common.get("rng")
        same_layout = (common.get("world_size") == world and common.get("layout")
                       == dict(getattr(mesh, "sizes", {}) or {}))
        if load_rng and rngs and same_layout:
            set_rng_state(rngs[rank])
            common["rng_restored"] = True
        common["fp8_note"] = (restore_fp8_state(model, common, rank, same_layout, ckpt_dir)
                              or restore_te_state(model, common, rank, same_layout, ckpt_dir))
    return common


def read_dist_tensors(ckpt_dir: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` as one whole tensor, in this process (no process group)."""
    meta = read_metadata(ckpt_dir)
    # Whole tensors in host memory (conversion and inspection, never training).
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype, device="cpu")
            for k, m in meta.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    _dcp_load(want, ckpt_dir, no_dist=True)
    return want


def load_single_process_model(ckpt_dir: str, model: nn.Module) -> dict:
    """Load a torch_dist checkpoint of any layout into a single-process GPTModel."""
    return load_dist_checkpoint(ckpt_dir, model, None, None, None, load_optim=False,
                                load_rng=False, finetune=True, single=True)


def _saved_dtype(meta: dict) -> torch.dtype:
    for key, m in meta.items():
        if key.startswith("model.") and hasattr(m, "properties"):
            return m.properties.dtype
    return torch.float32


def build_single_process_model(ckpt_dir: str) -> tuple[nn.Module, dict]:
    """A single-process GPTModel (saved dtype) with the weights of a torch_dist checkpoint
    of any layout, and the checkpoint's common state."""
    common = read_common(ckpt_dir)
    if not common.get("model_config"):
        raise CheckpointError(f"{os.path.join(ckpt_dir, COMMON)}: holds no model config")
    model = GPTModel(ModelConfig.from_dict(common["model_config"]))
    model = model.to(_saved_dtype(read_metadata(ckpt_dir)))
    load_single_process_model(ckpt_dir, model)
    return model, common


def read_dist_checkpoint(ckpt_dir: str) -> dict:
    """The single-file view of a torch_dist checkpoint (read_checkpoint's format): "model"
    is the single-process state_dict; optimizer states stay in the directory
    (read_dist_tensors(ckpt_dir, "optimizer."))."""
    model, common = build_single_process_model(ckpt_dir)
    return {**common, "model": model.state_dict(), "optimizer": None, "_file": ckpt_dir}
