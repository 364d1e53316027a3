"""Megatron-LM checkpoints <-> megamoe checkpoints (convert.py's megatron-to-megamoe and
megamoe-to-megatron directions).

Megatron side: a --save directory of Megatron-LM (megatron-core >= 0.14 torch_dist:
`latest_checkpointed_iteration.txt`, `iter_0000NNN/` with DCP files, `.metadata`,
`metadata.json`; the common state as a byte item or a legacy `common.pt`), or one
`iter_N` directory. Reading also takes the legacy `--ckpt-format torch` layout
(`mp_rank_*/model_optim_rng.pt` per rank, merged: megatron_legacy.py); writing is
torch_dist only. Names and layouts: megamoe/model/megatron_mapping.py; the saved args:
megamoe/cli/megatron_args.py; the common state's restricted unpickling:
megamoe/training/checkpoint/megatron_common.py. Nothing is written until every tensor is
read, mapped and shape-checked; the output is published by rename, the tracker last.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from checks import ConvertError, build_args, check_shapes, read_megamoe_checkpoint
from megatron_dp_reshard import NotModelled, read_flat_states
from megatron_legacy import is_legacy, read_megatron_legacy
from megatron_legacy_optim import read_legacy_optimizer
from megatron_main_check import main_params_differ
from megatron_optim import NAMES, find_optimizer, is_flat, read_states, step_of, to_megamoe_states
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from megamoe.cli.mapping import run_config_from_args
from megamoe.cli.megatron_args import (
    MegatronArgsError,
    flags_from_args,
    megatron_cannot_express,
    megatron_namespace,
    vocab_size_of,
)
from megamoe.config import ModelConfig, OptimizerConfig, to_dict
from megamoe.model import megatron_mapping
from megamoe.model.gpt_model import GPTModel
from megamoe.model.megatron_mla import mla_extra_state_modules
from megamoe.training.checkpoint import (
    save_dist_checkpoint,
)
from megamoe.training.checkpoint.dist import _dcp_load
from megamoe.training.checkpoint.megatron_common import COMMON_KEY, read_megatron_common
from megamoe.training.checkpoint.safe_load import read_dcp_metadata
from megamoe.training.optim.mixed_precision import MixedPrecisionOptimizer
from megamoe.training.schedules.lr import LRScheduler, schedule_lengths

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version


# ---------------------------------------------------------------- reading Megatron

def find_iteration_dir(path: str) -> str:
    """`path` itself when it is an iteration directory (torch_dist or legacy), else the
    one its tracker names."""
    if os.path.isfile(os.path.join(path, ".metadata")) or is_legacy(path):
        return path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        raise ConvertError(f"{tracker}: missing (--input must be a Megatron-LM --save "
                           "directory or one of its iter_N directories)")
    text = open(tracker, encoding="utf-8", errors="replace").read().strip()
    if text == "release":
        it_dir = os.path.join(path, "release")
    elif re.fullmatch(r"\d{1,12}", text):
        it_dir = os.path.join(path, f"iter_{int(text):07d}")
    else:
        raise ConvertError(f"{tracker}: expected an iteration number or 'release', "
                           f"got {text[:40]!r}")
    if not os.path.isdir(it_dir):
        raise ConvertError(f"{it_dir}: missing (named by {tracker})")
    if not os.path.isfile(os.path.join(it_dir, ".metadata")) and not is_legacy(it_dir):
        raise ConvertError(f"{it_dir}: neither a torch_dist checkpoint (.metadata) nor a "
                           "legacy torch one (mp_rank_*/model_optim_rng.pt)")
    return it_dir


def _check_backend(it_dir: str) -> None:
    path = os.path.join(it_dir, "metadata.json")
    if not os.path.isfile(path):
        return  # written last by megatron-core; old saves may lack it
    try:
        backend = json.load(open(path, encoding="utf-8")).get("sharded_backend")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise ConvertError(f"{path}: not valid JSON") from None
    if backend != "torch_dist":
        raise ConvertError(f"{path}: sharded_backend {backend!r}: only torch_dist is read")


def _nonneg_int(value, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConvertError(f"{where}: {what} = {value!r} is not a non-negative integer")
    return value


def _shards_hold(it_dir: str, tensors: dict[str, torch.Tensor], what: str) -> None:
    """The index is untrusted: its shapes may not promise more bytes than the shards hold."""
    need = sum(t.numel() * t.dtype.itemsize for t in tensors.values())
    held = sum(os.path.getsize(os.path.join(it_dir, n)) for n in os.listdir(it_dir)
               if n.endswith(".distcp"))
    if need > held:
        raise ConvertError(f"{it_dir}/.metadata: describes {need} bytes of {what}, the "
                           f"shards hold {held} (truncated or not this checkpoint's index)")


def read_megatron(it_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the common state, every model tensor whole) of a Megatron iteration directory."""
    _check_backend(it_dir)
    metadata = read_dcp_metadata(os.path.join(it_dir, ".metadata"))
    common = read_megatron_common(it_dir, metadata.storage_data or {})
    metas = {k: m for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.")
             and not k.startswith("chained_")}
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype, device="cpu")
            for k, m in metas.items()}
    _shards_hold(it_dir, want, "tensors")
    _dcp_load(want, it_dir, no_dist=True)
    return common, want


def read_megatron_optimizer(it_dir: str, common: dict, weights: dict[str, torch.Tensor],
                            config: ModelConfig, params: dict[str, torch.Tensor]
                            ) -> tuple[Optional[dict], Optional[int], str]:
    """(megamoe state name -> {parameter name: fp32 tensor}, the step count, what was
    imported) of a torch_dist checkpoint's optimizer, or (None, None, why not)."""
    metadata = read_dcp_metadata(os.path.join(it_dir, ".metadata"))
    if is_flat(common):
        return _read_flat_optimizer(it_dir, common, metadata, weights, config, params)
    found, why = find_optimizer(common, metadata, it_dir)
    if found is None:
        return None, None, why
    states = read_states(found, metadata, weights, it_dir)
    flat = {found.keys[name][key]: t for name, by in states.items() for key, t in by.items()}
    _shards_hold(it_dir, {**weights, **flat}, "tensors and optimizer states")
    _dcp_load(flat, it_dir, no_dist=True)
    mapped = to_megamoe_states(states, config, params, it_dir)
    return mapped, found.step, f"Adam state of {found.kind} at step {found.step}"


def _read_flat_optimizer(it_dir: str, common: dict, metadata, weights: dict, config,
                         params: dict) -> tuple[Optional[dict], Optional[int], str]:
    """read_megatron_optimizer for the dp_reshardable flat buffers (megatron_dp_reshard)."""
    optimizer = getattr(common["args"], "optimizer", "adam")
    if optimizer not in ("adam", None):
        return None, None, f"only Adam's state is read (args.optimizer = {optimizer!r})"

    def load(flat: dict) -> None:
        _shards_hold(it_dir, {**weights, **flat}, "tensors and optimizer states")
        _dcp_load(flat, it_dir, no_dist=True)
    try:
        raw, part = read_flat_states(it_dir, common, metadata, weights, load)
    except NotModelled as e:
        return None, None, ("the distributed optimizer's 'dp_reshardable' layout is not "
                            f"rebuilt: {e}")
    except ConvertError as e:  # (an args field's message names no file: the args')
        msg = str(e)
        raise ConvertError(msg if msg.startswith(it_dir) else f"{it_dir} (args): {msg}"
                           ) from None
    step = step_of(part, it_dir)
    states = {NAMES[k]: v for k, v in raw.items()}
    wrong = main_params_differ(_main_as_read(states, config), params)
    if wrong is not None:
        return None, None, ("the distributed optimizer's 'dp_reshardable' layout is not "
                            f"rebuilt: {wrong}")
    mapped = to_megamoe_states(states, config, params, it_dir)
    return mapped, step, ("Adam state of the distributed optimizer (dp_reshardable) at step "
                          f"{step}")


def _main_as_read(states: dict, config) -> dict[str, torch.Tensor]:
    """The main parameters as the rebuilt layout read them, mapped but not yet validated:
    the main-parameter check runs first, because a wrong layout also reads the gaps'
    garbage into the moments (NaN, negative exp_avg_sq), which is a layout not rebuilt,
    not a corrupt file. Unmappable: empty (to_megamoe_states then names what is wrong)."""
    try:
        return megatron_mapping.to_megamoe(dict(states["main"]), config)
    except (KeyError, ValueError, RuntimeError):
        return {}


def _optimizer_with(model: GPTModel, optim_config, states: dict, step: int
                    ) -> MixedPrecisionOptimizer:
    """megamoe's own optimizer for `model`, holding the imported states: saved through it,
    the checkpoint has what `--load` restores (dist.py: main, exp_avg, exp_avg_sq and the
    step count)."""
    optimizer = MixedPrecisionOptimizer(model, optim_config)
    names = {id(p): n for n, p in model.named_parameters()}
    per_param = []
    for p in optimizer.model_params:
        name = names[id(p)]
        st = {k: by[name] for k, by in states.items() if k != "main"}
        if "main" in states and optimizer.separate_main:
            st["main"] = states["main"][name]
        per_param.append(st)
    optimizer.load_param_states(per_param, torch.tensor(float(step)))
    return optimizer


class _Schedule:
    """The LR schedule's position as megamoe's scheduler saves it."""

    def __init__(self, num_steps: int) -> None:
        self.num_steps = num_steps

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "unit": LRScheduler.UNIT}


def megatron_to_megamoe(path: str, out_dir: str, overrides: list[str]) -> tuple[str, str]:
    """Convert; returns (the published directory, what travelled)."""
    it_dir = find_iteration_dir(path)
    legacy = not os.path.isfile(os.path.join(it_dir, ".metadata"))
    common, tensors, ranks = (read_megatron_legacy(it_dir) if legacy
                              else (*read_megatron(it_dir), None))
    where = f"{it_dir} (args)"
    try:
        ns = common["args"]
        flags = flags_from_args(ns) + list(overrides)
        vocab, _ = vocab_size_of(ns)
    except MegatronArgsError as e:
        raise ConvertError(f"{where}: {e}") from None
    args = build_args(flags, where)
    run = run_config_from_args(args, vocab)
    config = run.model
    try:
        sd = megatron_mapping.to_megamoe(tensors, config)
    except (KeyError, ValueError, RuntimeError) as e:
        msg = e.args[0] if e.args else str(e)
        raise ConvertError(f"{it_dir}: weights do not fit the saved args ({msg})") from None
    check_shapes(sd, config, it_dir)
    iteration = _nonneg_int(common.get("iteration", 0), "iteration", it_dir)
    consumed = _nonneg_int(getattr(ns, "consumed_train_samples", 0) or 0,
                           "args.consumed_train_samples", it_dir)
    sched = common.get("opt_param_scheduler")
    steps = consumed
    if isinstance(sched, dict) and "num_steps" in sched:
        steps = _nonneg_int(sched["num_steps"], "opt_param_scheduler.num_steps", it_dir)
    saved_args = {k: v for k, v in vars(args).items()
                  if isinstance(v, (int, float, str, bool, list, type(None)))}
    saved_args.update(skip_train=False, ckpt_format="torch_dist", dry_run=False)
    with torch.device("meta"):
        model = GPTModel(config)
    model.load_state_dict(sd, strict=True, assign=True)
    optimizer, params = None, dict(model.named_parameters())
    states, step, optim_note = (
        read_legacy_optimizer(it_dir, common, ranks, config, params) if legacy
        else read_megatron_optimizer(it_dir, common, tensors, config, params))
    if states is not None:
        optimizer = _optimizer_with(model, run.optim, states, step)
    final = save_dist_checkpoint(out_dir, iteration, model, optimizer, _Schedule(steps),
                                 None, consumed, saved_args, model_config=to_dict(config),
                                 save_optim=optimizer is not None, save_rng=False,
                                 single=True)
    what = (f"weights, schedule and {optim_note}" if optimizer is not None else
            f"weights and schedule only: the optimizer state is not imported ({optim_note}; "
            "--load starts fresh Adam moments)")
    note = (f"iteration {iteration}, {consumed} consumed samples, LR schedule at {steps} "
            f"samples; {what}")
    return final, note


# ---------------------------------------------------------------- writing Megatron

def _extra_state_keys(config: ModelConfig) -> list[str]:
    """The `_extra_state` byte items megatron-core's load asks for (one per module shard,
    None for a module without FP8 state), named as megatron-core names them."""
    stacked = megatron_mapping.stacked_layers(config)
    L = config.num_layers
    out: list[str] = []
    for i in range(L):
        layer = f"decoder.layers.{'' if stacked else f'{i}.'}"
        out += _layer_extra_state(config, i, layer, L if stacked else None)
    for k in range(config.num_mtp_layers):  # one key per depth, never stacked
        out.append(f"mtp.layers.{k}.eh_proj._extra_state/shard_0_1")
        out += _layer_extra_state(config, L + k, f"mtp.layers.{k}.transformer_layer.", None)
    return sorted(set(out))


def _layer_extra_state(config: ModelConfig, i: int, layer: str, stacked_of: Optional[int]
                       ) -> list[str]:
    """Layer `i`'s items: `layer` its key prefix; `stacked_of`: L when the layers are
    stacked (the shard index then names the layer too), None for a per-layer key."""
    loc = f"{i}_{stacked_of}" if stacked_of else "0_1"
    names = (mla_extra_state_modules(config) if config.multi_latent_attention
             else ["self_attention.linear_qkv", "self_attention.linear_proj"])
    out = []
    if config.is_moe_layer(i):
        moe_e = config.moe.num_experts
        if config.moe.shared_expert_intermediate_size:
            names += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
        for e in range(moe_e):
            for fc in ("linear_fc1", "linear_fc2"):
                shard = f"{i}.{e}_{stacked_of}.{moe_e}" if stacked_of else f"{e}_{moe_e}"
                out.append(f"{layer}mlp.experts.experts.{fc}._extra_state/shard_{shard}")
    else:
        names += ["mlp.linear_fc1", "mlp.linear_fc2"]
    return out + [f"{layer}{n}._extra_state/shard_{loc}" for n in names]


class _PackedBytesPlanner(DefaultSavePlanner):
    """DCP's save planner, except that a byte item already packed as io.BytesIO is written
    as is (DCP's default would torch.save the BytesIO object around it), as megatron-core's
    MCoreSavePlanner writes its ShardedObjects."""

    def transform_object(self, write_item, object):
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


def _pickled(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save([obj], buf)  # a ShardedObject's one shard, as megatron-core stores it
    buf.seek(0)
    return buf


def _scheduler_state(state: dict, config_args: dict) -> dict:
    """Megatron's OptimizerParamScheduler.state_dict() for megamoe's schedule position."""

    sched = state.get("scheduler") or {}
    gbs = int(config_args.get("global_batch_size") or 1)
    optim = OptimizerConfig(**{k: config_args[k] for k in (
        "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters",
        "lr_warmup_samples", "lr_decay_samples", "lr_warmup_fraction", "lr_warmup_init",
        "lr_wsd_decay_iters", "lr_wsd_decay_samples", "lr_wsd_decay_style")
        if k in config_args})
    warmup, decay, _ = schedule_lengths(optim, int(config_args.get("train_iters") or 0),
                                        gbs, config_args.get("train_samples"))
    wd = config_args.get("weight_decay", 0.01)
    return {"max_lr": optim.lr, "lr_warmup_steps": warmup, "num_steps":
            int(sched.get("num_steps", state.get("consumed_train_samples", 0))),
            "lr_decay_style": optim.lr_decay_style, "lr_decay_steps": decay,
            "min_lr": optim.min_lr, "start_wd": wd, "end_wd": wd,
            "wd_incr_style": "constant", "wd_incr_steps": decay}


def megamoe_to_megatron(ckpt: str, out_dir: str, spec: str) -> str:
    """Convert; returns the published iteration directory."""
    state, config = read_megamoe_checkpoint(ckpt)
    file = state["_file"]
    why = megatron_cannot_express(config)
    if why:
        raise ConvertError(f"{file}: cannot be written for Megatron-LM: {why}")
    try:
        tensors = megatron_mapping.to_megatron(state["model"], config, spec)
    except (KeyError, ValueError) as e:
        raise ConvertError(f"{file}: {e.args[0] if e.args else e}") from None
    iteration = int(state.get("iteration", 0))
    args = dict(state.get("args") or {})
    ns = megatron_namespace(args, config, iteration, int(state.get("consumed_train_samples",
                                                                  0)),
                            config.padded_vocab_size,
                            {"transformer_impl": "transformer_engine" if spec == "te"
                             else "local"})
    common = {"args": ns, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
              "opt_param_scheduler": _scheduler_state(state, args),
              "num_floating_point_operations_so_far": 0}
    return write_megatron(out_dir, iteration, tensors, common, _extra_state_keys(config))


def write_megatron(out_dir: str, iteration: int, tensors: dict[str, torch.Tensor],
                   common: dict, extra_state_keys: list[str]) -> str:
    """A Megatron-LM torch_dist iteration directory (DCP files, the common state as
    megatron-core's `common_state` byte item, `_extra_state` items, metadata.json), written
    to a temporary name, then published by rename, the tracker file last."""
    items: dict = dict(tensors)
    items[COMMON_KEY] = _pickled(common)
    for key in extra_state_keys:
        items[key] = _pickled(None)
    name = f"iter_{iteration:07d}"
    final = os.path.join(out_dir, name)
    if os.path.exists(final):
        raise ConvertError(f"--output {out_dir}: already holds {name} (choose a new folder)")
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f"{name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        dcp.save(items, checkpoint_id=tmp, no_dist=True,
                 planner=_PackedBytesPlanner(flatten_state_dict=False))
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with open(os.path.join(out_dir, f"{TRACKER}.tmp"), "w") as f:
        f.write(str(iteration))
    os.replace(os.path.join(out_dir, f"{TRACKER}.tmp"), os.path.join(out_dir, TRACKER))
    return final


def check_megatron_output(out: str) -> Optional[str]:
    """Why `out` cannot receive a Megatron checkpoint, or None."""
    if os.path.exists(os.path.join(out, TRACKER)):
        return f"--output {out}: already holds a checkpoint (choose a new folder)"
    return None
