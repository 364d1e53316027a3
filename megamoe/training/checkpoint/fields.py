"""The non-tensor fields a checkpoint file carries (iteration, data position, scheduler,
optimizer step, loss scaler, RNG states), checked for type and range before anything uses them.

A checkpoint may come from elsewhere and be damaged or edited: a field of the wrong type
would otherwise surface as a traceback deep in the load (int("abc"), a KeyError, numpy
refusing a state) or, worse, load: a negative iteration or sample count resumes the data
and the schedule somewhere no run has been. Each problem is one CheckpointError naming
the file and the field; no message quotes the field's content (only its type).
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable

import numpy as np
import torch

from megamoe.config.optim import FP32_MAX
from megamoe.training.checkpoint.safe_load import CheckpointError


def field_error(path: str, field: str, problem: str) -> CheckpointError:
    """The one-line error for a bad field (named, never quoted)."""
    return CheckpointError(f"{path}: field {field!r} {problem}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(path: str, state: dict, field: str) -> None:
    if field not in state:
        raise field_error(path, field, "is missing")
    value = state[field]
    if not _is_count(value):
        found = value if isinstance(value, int) and not isinstance(value, bool) \
            else type(value).__name__  # a negative number, or only the type
        raise field_error(path, field, f"must be a non-negative integer, found {found}")


def _scheduler(path: str, sched: Any) -> None:
    if sched is None:
        return
    if not isinstance(sched, dict):
        raise field_error(path, "scheduler", f"must be a dict, found {type(sched).__name__}")
    if not _is_count(sched.get("num_steps")):
        raise field_error(path, "scheduler.num_steps", "must be a non-negative integer")
    if not isinstance(sched.get("unit", ""), str):
        raise field_error(path, "scheduler.unit", "must be a string")


def _accepted(set_state: Callable[[Any], Any], state: Any) -> bool:
    """Whether a throwaway generator takes `state` (the consumer's own check of every
    element's type and range; the process's generators are not touched)."""
    try:
        set_state(state)
    except (TypeError, ValueError, OverflowError, RuntimeError, KeyError, IndexError):
        return False
    return True


def _rng(path: str, field: str, rng: Any) -> None:
    """One process's RNG states as rng_state.py saves them."""
    if not isinstance(rng, dict) or not {"python", "numpy", "torch"} <= rng.keys():
        raise field_error(path, field, "must be a dict of python, numpy and torch RNG states")
    py = rng["python"]
    if not (isinstance(py, tuple) and len(py) == 3 and isinstance(py[1], tuple)
            and all(isinstance(x, int) for x in py[1])
            and _accepted(random.Random().setstate, py)):
        raise field_error(path, f"{field}.python", "is not a Python random state")
    npy = rng["numpy"]
    if not (isinstance(npy, tuple) and len(npy) == 5 and isinstance(npy[0], str)
            and isinstance(npy[1], np.ndarray) and npy[1].dtype == np.uint32
            and npy[1].shape == (624,)
            and _accepted(np.random.RandomState().set_state, npy)):
        raise field_error(path, f"{field}.numpy", "is not a numpy MT19937 state")
    for key in ("torch", "cuda"):
        t = rng.get(key)
        if key in rng and not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                               and t.dim() == 1):
            raise field_error(path, f"{field}.{key}", "is not a torch generator state "
                        "(a 1-D uint8 tensor)")
    cpu_generator = torch.Generator(device="cpu")  # the saved state is the CPU generator's
    if not _accepted(cpu_generator.set_state, rng["torch"]):
        raise field_error(path, f"{field}.torch", "is not a torch CPU generator state")


def _step(path: str, optim: Any) -> None:
    if optim is None:
        return
    if not isinstance(optim, dict) or not isinstance(optim.get("names"), list) or not all(
            isinstance(n, str) for n in optim["names"]):
        raise field_error(path, "optimizer", "must hold the state names (a list of strings)")
    step = optim.get("step")
    if step is None:
        if "exp_avg" in optim["names"]:  # Adam's moments without their step count
            raise field_error(path, "optimizer.step", "is missing (Adam's moments are saved)")
        return
    ok = isinstance(step, torch.Tensor) and step.is_floating_point()
    if not (ok and is_step_count(step)):
        raise field_error(path, "optimizer.step", "must be a non-negative whole number "
                    "(a 1-element float tensor)")


def is_step_count(v: Any) -> bool:
    """Whether `v` is an Adam step count: a non-negative whole number, as a Python number
    or a 1-element tensor (torch keeps it as a tensor, apex in the param group as an int).
    Bias correction divides by 1 - beta^step, so a fractional or negative count would
    train on silently wrong moments; both checkpoint readers share this rule."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            return False
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return math.isfinite(v) and v >= 0 and v == int(v)


def _grad_scaler(path: str, optim: Any) -> None:
    """The loss scaler's state (--fp16; optimizer["grad_scaler"]): absent (an older
    checkpoint, or no scaler), empty (a constant scale), or Megatron's three fields: a
    positive scale finite in fp32, a non-negative growth tracker, an integer hysteresis tracker
    (it counts down through zero while overflows continue)."""
    if not isinstance(optim, dict) or "grad_scaler" not in optim:
        return
    field, scaler = "optimizer.grad_scaler", optim["grad_scaler"]
    if not isinstance(scaler, dict):
        raise field_error(path, field, f"must be a dict, found {type(scaler).__name__}")
    if not scaler:
        return
    scale = scaler.get("scale")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
            and math.isfinite(scale) and 0 < scale <= FP32_MAX):
        raise field_error(path, f"{field}.scale", "must be a positive number finite in fp32")
    if not _is_count(scaler.get("growth_tracker")):
        raise field_error(path, f"{field}.growth_tracker", "must be a non-negative integer")
    tracker = scaler.get("hysteresis_tracker")
    if not (isinstance(tracker, int) and not isinstance(tracker, bool)
            and abs(tracker) < 2**62):
        raise field_error(path, f"{field}.hysteresis_tracker", "must be an integer")


def check_fields(path: str, state: Any, dist: bool = False) -> dict:
    """`state` (a single file's, or with `dist` common.pt's: one RNG state per saved rank,
    the optimizer's step) with checked fields; CheckpointError naming `path` and the
    field."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a megamoe checkpoint ({type(state).__name__})")
    _count(path, state, "iteration")
    _count(path, state, "consumed_train_samples")
    _scheduler(path, state.get("scheduler"))
    rng = state.get("rng")
    _grad_scaler(path, state.get("optimizer"))
    if not dist:
        if rng is not None:
            _rng(path, "rng", rng)
        return state
    _count(path, state, "world_size")
    if rng is not None:
        if not isinstance(rng, list) or len(rng) != state["world_size"]:
            raise field_error(path, "rng", "must hold one RNG state per saved rank")
        for i, r in enumerate(rng):
            _rng(path, f"rng[{i}]", r)
    fp8 = state.get("fp8")
    if fp8 is not None and (not isinstance(fp8, list) or len(fp8) != state["world_size"]
                            or not all(isinstance(r, dict) for r in fp8)):
        raise field_error(path, "fp8", "must hold one FP8 scaling state (a dict) per saved rank")
    if not isinstance(state.get("layout", {}), dict):
        raise field_error(path, "layout", "must be a dict")
    _step(path, state.get("optimizer"))
    return state
