"""A checkpoint holds the state of the iteration it is saved at, whenever it is written.

An async save writes on a background thread while training goes on mutating the live
optimizer, scheduler and RNG objects; anything the save captured by reference (a tensor
that `.to("cpu")` returned as itself, a dict the scheduler keeps updating, a numpy array)
would be written with the values of a later iteration, and a resume from that checkpoint
would be silently wrong. `snapshot` is applied to everything a save captures before the
call returns: tensors are cloned, numpy arrays copied, containers rebuilt; immutable
leaves (numbers, strings, None) are shared.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch


def snapshot(obj: Any) -> Any:
    """A deep copy of `obj` that no later training step can change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):  # (copy() keeps OrderedDict / defaultdict types)
        out = obj.copy()
        for k, v in obj.items():
            out[k] = snapshot(v)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(snapshot(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return obj
    return copy.deepcopy(obj)  # anything else (a set, an enum, a dataclass): its own copy
