"""The optimizer state of a Megatron-LM torch_dist checkpoint -> megamoe's (convert.py's
megatron-to-megamoe).

What megatron-core 0.19 saves (megatron/core/optimizer/optimizer.py, distrib_optimizer.py;
checked against real saves in tests/tools/megatron_peer/peer_optim.py):

- the non-distributed optimizers (FP32Optimizer, Float16OptimizerWithFloat16Params):
  `optimizer.state.{exp_avg,exp_avg_sq}.<model key>` shaped as the model tensor, with
  Float16's fp32 main copy as `optimizer.state.fp32_param.<model key>`; the step count in
  the common state, `optimizer[.optimizer].state.common_step`;
- the distributed optimizer in `fully_reshardable` (--dist-ckpt-optim-fully-reshardable):
  `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`, model-shaped (`param`: the
  fp32 main parameter), the step in `optimizer.optimizer.param_groups[*].step`;
- a ChainedOptimizer (dense and expert optimizers) the same per chained optimizer, the
  tensor keys prefixed `chained_N.` unless `chained_optim_avoid_prefix`, its common part
  a dict {N: ...};
- the distributed optimizer's `dp_reshardable` (Megatron-LM's default) flat DP buffers:
  megatron_dp_reshard.py cuts them into model-shaped states, then the same mapping and
  checks as here (`is_flat`);
- `fully_sharded_model_space` (flattened ranges; megatron-core 0.19 refuses to save it)
  and the other layouts: not read (the caller keeps weights and schedule only).

Model-shaped states are whole tensors in DCP whatever TP / PP / EP the run used, so each
state is mapped with megatron_mapping.to_megamoe, the same mapping as the weights (TP
merges, the qkv interleave, stacked layers and experts). Everything read is untrusted:
a state missing for some parameter, another shape, a non-float or non-finite tensor, a
negative exp_avg_sq or an odd step count is a ConvertError naming the file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
from checks import ConvertError
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megamoe.config import ModelConfig
from megamoe.model import megatron_mapping

_KEY = re.compile(r"(?:chained_\d+\.)?optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)"
                  r"\.(.+)")
# Megatron's state name -> megamoe's (optim_fields / dist.py: main, exp_avg, exp_avg_sq)
NAMES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "main",
         "param": "main"}
MODEL_SPACE = ("fully_reshardable",)
FLAT = "dp_reshardable"
MAX_STEP = 2**40


@dataclass
class MegatronOptimizer:
    """What a checkpoint's optimizer state holds: the DCP keys of each state (megamoe's
    state name -> Megatron model key -> DCP key), the step count, and its kind in words."""

    keys: dict[str, dict[str, str]]
    step: int
    kind: str


def _sharding_type(common: dict) -> Optional[str]:
    """The distributed optimizer's `distrib_optim_sharding_type` (None: the
    non-distributed optimizer, whose states are model-shaped)."""
    meta = common.get("content_metadata")
    found = meta.get("distrib_optim_sharding_type") if isinstance(meta, dict) else None
    for part in _parts(common.get("optimizer")):
        found = found or part.get("param_state_sharding_type")
    if found is not None and not isinstance(found, str):
        return "?"
    args = common.get("args")
    if found is None and getattr(args, "use_distributed_optimizer", False):
        return "dp_reshardable"  # (Megatron-LM's default when nothing says otherwise)
    return found


def is_flat(common: dict) -> bool:
    """A distributed optimizer state saved in the flat dp_reshardable buffers."""
    return _sharding_type(common) == FLAT and bool(_parts(common.get("optimizer")))


def step_of(common: dict, where: str) -> int:
    """The one step count the optimizers' common parts record (checked)."""
    return _step(common, where)


def _parts(optim: Any) -> list[dict]:
    """The per-optimizer common parts: a ChainedOptimizer's {N: part} or one part."""
    if isinstance(optim, dict) and optim and all(isinstance(k, int) for k in optim):
        return [v for _, v in sorted(optim.items()) if isinstance(v, dict)]
    return [optim] if isinstance(optim, dict) else []


def _step_values(part: dict) -> list[Any]:
    """Every step count a common part records (common_step; param_groups' step)."""
    out = []
    for holder in (part, part.get("optimizer")):
        if not isinstance(holder, dict):
            continue
        state = holder.get("state")
        if isinstance(state, dict) and "common_step" in state:
            out.append(state["common_step"])
        groups = holder.get("param_groups")
        if isinstance(groups, list):
            out += [g["step"] for g in groups if isinstance(g, dict) and "step" in g]
    return out


def _step(common: dict, where: str) -> int:
    values = [v for part in _parts(common.get("optimizer")) for v in _step_values(part)]
    steps = set()
    for v in values:
        if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype.is_complex:
            v = v.item()
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or v != int(v) or not 0 < v <= MAX_STEP):
            raise ConvertError(f"{where}: optimizer step count {v!r} is not an integer in "
                               f"[1, {MAX_STEP}]")
        steps.add(int(v))
    if len(steps) != 1:
        raise ConvertError(f"{where}: optimizer step counts {sorted(steps) or 'none'}: "
                           "expected one shared step (megatron-core's common_step)")
    return steps.pop()


def find_optimizer(common: dict, metadata, where: str) -> tuple[Optional[MegatronOptimizer],
                                                                 str]:
    """(what to import, or None with the reason the optimizer state is not imported)."""
    keys: dict[str, dict[str, str]] = {}
    for dcp_key in metadata.state_dict_metadata:
        m = _KEY.fullmatch(dcp_key)
        if m is not None:
            name = NAMES[m.group(1)]
            if m.group(2) in keys.setdefault(name, {}):
                raise ConvertError(f"{where}: two optimizer states for {name} of "
                                   f"{m.group(2)}")
            keys[name][m.group(2)] = dcp_key
    sharding = _sharding_type(common)
    if sharding is not None and sharding not in MODEL_SPACE:
        return None, (f"the distributed optimizer's {sharding!r} layout is not read "
                      "(only fully_reshardable and dp_reshardable)")
    if not keys or not _parts(common.get("optimizer")):
        return None, "the checkpoint holds no optimizer state (--no-save-optim?)"
    optimizer = getattr(common.get("args"), "optimizer", "adam")
    if optimizer not in ("adam", None):
        return None, f"only Adam's state is read (args.optimizer = {optimizer!r})"
    if sorted(keys) not in (["exp_avg", "exp_avg_sq"], ["exp_avg", "exp_avg_sq", "main"]):
        raise ConvertError(f"{where}: optimizer states {sorted(keys)}: expected exp_avg and "
                           "exp_avg_sq (and the fp32 main parameters)")
    kind = ("the non-distributed optimizer" if sharding is None
            else f"the distributed optimizer ({sharding})")
    return MegatronOptimizer(keys, _step(common, where), kind), ""


def read_states(found: MegatronOptimizer, metadata, weights: dict[str, torch.Tensor],
                where: str) -> dict[str, dict[str, torch.Tensor]]:
    """Every state's tensors by Megatron model key, each shaped as that weight."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, by_key in found.keys.items():
        params = {k for k in weights if "_extra_state" not in k}
        missing = sorted(params - set(by_key) - _buffers(params))
        extra = sorted(set(by_key) - params)
        if missing or extra:
            raise ConvertError(f"{where}: optimizer state {name} "
                               f"{'misses ' + missing[0] if missing else 'names ' + extra[0]}"
                               f"{' (and more)' if len(missing or extra) > 1 else ''}")
        out[name] = {}
        for key, dcp_key in by_key.items():
            meta = metadata.state_dict_metadata[dcp_key]
            if not (isinstance(meta, TensorStorageMetadata)
                    and tuple(meta.size) == tuple(weights[key].shape)
                    and meta.properties.dtype.is_floating_point):
                raise ConvertError(f"{where}: {dcp_key} is not a float tensor shaped "
                                   f"{list(weights[key].shape)} like its weight")
            out[name][key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return out


def _buffers(keys: set[str]) -> set[str]:
    """Model tensors that are buffers in megatron-core (no optimizer state)."""
    return {k for k in keys if k.endswith("router.expert_bias")}


def to_megamoe_states(states: dict[str, dict[str, torch.Tensor]], config: ModelConfig,
                      params: dict[str, torch.Tensor], where: str
                      ) -> dict[str, dict[str, torch.Tensor]]:
    """megamoe state name -> {GPTModel parameter name: fp32 tensor}, each state mapped as
    the weights are, then checked: every parameter, its shape, finite, exp_avg_sq >= 0."""
    out = {}
    for name, by_key in states.items():
        try:
            mapped = megatron_mapping.to_megamoe(by_key, config)
        except (KeyError, ValueError, RuntimeError) as e:
            msg = e.args[0] if e.args else str(e)
            raise ConvertError(f"{where}: optimizer state {name} does not fit the saved "
                               f"args ({msg})") from None
        if sorted(mapped) != sorted(params):
            odd = sorted(set(mapped) ^ set(params))
            raise ConvertError(f"{where}: optimizer state {name} does not cover the "
                               f"parameters ({odd[0]})")
        for key, t in mapped.items():
            t = t.float()
            if t.shape != params[key].shape or not bool(torch.isfinite(t).all()) or (
                    name == "exp_avg_sq" and bool((t < 0).any())):
                raise ConvertError(f"{where}: optimizer state {name} of {key}: not a finite "
                                   f"tensor shaped {list(params[key].shape)}"
                                   f"{' >= 0' if name == 'exp_avg_sq' else ''}")
            mapped[key] = t.contiguous()
        out[name] = mapped
    return out
