"""The optimizer state a single-file checkpoint carries, checked against the optimizer it is
about to load into.

torch's `Optimizer.load_state_dict` trusts its input: a hyperparameter of the wrong type,
a moment of the wrong shape or a state that is not a dict loads without a word and fails
at the first step, inside a fused kernel, as a traceback far from the file. Each problem
here is one CheckpointError naming the file and the field (never its content).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megamoe.training.checkpoint.fields import field_error, is_step_count


def _finite_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def _like(path: str, field: str, saved: Any, live: Any) -> None:
    """A hyperparameter as this optimizer holds it: the same kind of value, finite."""
    if live is None or isinstance(live, bool):  # (torch's fused/foreach: None = its pick)
        ok = saved is None or isinstance(saved, bool)
    elif isinstance(live, (int, float)):
        ok = _finite_number(saved)
    elif isinstance(live, (tuple, list)):
        ok = (isinstance(saved, (tuple, list)) and len(saved) == len(live)
              and all(_finite_number(x) for x in saved))
    elif isinstance(live, torch.Tensor):
        ok = (isinstance(saved, torch.Tensor) and saved.shape == live.shape
              and bool(torch.isfinite(saved).all()))
    elif isinstance(live, str):
        ok = saved is None or isinstance(saved, str)
    else:
        ok = True
    if not ok:
        raise field_error(path, field, f"must be like {type(live).__name__} "
                    f"(found {type(saved).__name__})")


def _groups(path: str, saved: Any, live_groups: list[dict]) -> dict[int, torch.Size]:
    """The saved param_groups against this optimizer's -> saved param id -> its shape."""
    field = "optimizer.optimizer.param_groups"
    if not isinstance(saved, list) or len(saved) != len(live_groups):
        raise field_error(path, field, f"must be a list of {len(live_groups)} groups")
    shapes: dict[int, torch.Size] = {}
    for g, (group, live) in enumerate(zip(saved, live_groups)):
        if not isinstance(group, dict):
            raise field_error(path, f"{field}[{g}]", "must be a dict")
        ids = group.get("params")
        if not (isinstance(ids, list) and len(ids) == len(live["params"])
                and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise field_error(path, f"{field}[{g}].params", f"must list {len(live['params'])} "
                        "parameter numbers")
        for key, value in live.items():
            if key != "params" and key in group:
                _like(path, f"{field}[{g}].{key}", group[key], value)
        shapes.update({i: p.shape for i, p in zip(ids, live["params"])})
    return shapes


def _states(path: str, saved: Any, shapes: dict[int, torch.Size]) -> None:
    field = "optimizer.optimizer.state"
    if not isinstance(saved, dict):
        raise field_error(path, field, "must be a dict")
    for i, state in saved.items():
        if i not in shapes or not isinstance(state, dict):
            raise field_error(path, f"{field}", "must map the groups' parameter numbers to dicts")
        if "exp_avg" in state and "step" not in state:  # bias correction needs the count
            raise field_error(path, f"{field}[{i}].step", "is missing (Adam's moments are saved)")
        for name, v in state.items():
            where = f"{field}[{i}].{name}"
            if name == "step":
                if not is_step_count(v):
                    raise field_error(path, where, "must be a non-negative whole number")
            elif not (isinstance(v, torch.Tensor) and v.is_floating_point()
                      and v.shape == shapes[i]):
                raise field_error(path, where, f"must be a float tensor of shape {list(shapes[i])}")


def check_optimizer_state(path: str, saved: Any, optimizer: Any) -> None:
    """`saved` (a wrapper's state_dict: {"optimizer": torch's, "main_params"?, ...}) fits
    `optimizer` (MixedPrecisionOptimizer or DistributedOptimizer); else CheckpointError."""
    if not isinstance(saved, dict) or not isinstance(saved.get("optimizer"), dict):
        raise field_error(path, "optimizer", "must be a dict holding the optimizer's state")
    inner = saved["optimizer"]
    live_groups = optimizer.optimizer.param_groups
    shapes = _groups(path, inner.get("param_groups"), live_groups)
    _states(path, inner.get("state"), shapes)
    if "main_params" in saved:  # (MixedPrecisionOptimizer's copies, else the pieces')
        live = (optimizer.main_params if hasattr(optimizer, "main_params")
                else [piece.main for piece in optimizer._pieces()])
        mains = saved["main_params"]
        if not (isinstance(mains, list) and len(mains) == len(live) and all(
                isinstance(m, torch.Tensor) and m.is_floating_point() and m.shape == p.shape
                for m, p in zip(mains, live))):
            raise field_error(path, "optimizer.main_params", f"must be {len(live)} float tensors "
                        "shaped as the parameters")
