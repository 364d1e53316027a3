"""Reading a Megatron-LM torch_dist checkpoint's common state without running its code.

Megatron-LM's training loop saves, besides the sharded model, a common state dict: the
run's argparse Namespace `args`, `iteration`, `checkpoint_version`, `opt_param_scheduler`,
`num_floating_point_operations_so_far`, (optionally) `rng_state` and the optimizer's
common part. megatron-core >= 0.15 stores it as one pickled byte item `common_state/
shard_0_1` inside the DCP files (a torch.save zip of `[common]`); older versions as
`common.pt` next to them. Both are pickles that a crafted checkpoint could use to run
code, so they are unpickled here with an Unpickler that resolves only:

- `argparse.Namespace`, `collections.OrderedDict`, torch dtypes, torch's tensor rebuild
  (tensors in the RNG states);
- numpy's array reconstruction and `_codecs.encode` (the numpy RNG state in a legacy
  `model_optim_rng.pt`'s `rng_state`; protocol-2 pickles spell bytes through it);
- names under `megatron.` (Megatron's enums such as `AttnBackend` in `args`) and
  `_io.BytesIO` (Transformer Engine's `_extra_state` in a legacy file): never built as
  themselves, each becomes an inert `ForeignValue` recording its name and arguments.

Anything else fails with CheckpointError naming the file and the refused global.
Megatron-LM's legacy `--ckpt-format torch` files (`mp_rank_*/model_optim_rng.pt`, whole
torch.save dicts of args, weights, optimizer and RNG state) go through the same unpickler
(`load_megatron_torch_file`).
"""

from __future__ import annotations

import argparse
import codecs
import collections
import io
import os
import pickle
import types
from typing import Any, Optional

import numpy as np
import torch
import torch._utils

from megamoe.training.checkpoint.safe_load import CheckpointError

COMMON_KEY = "common_state/shard_0_1"
LEGACY_COMMON = "common.pt"


class ForeignValue:
    """A Megatron object (an enum member, a small config object) seen as data: its
    qualified name, the arguments pickle would have called it with, and its state."""

    qualname = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> ForeignValue:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


class _TensorType(ForeignValue):
    """torch.Tensor named as the type argument of a tensor saved with Python attributes
    (an inert record: never called to build anything)."""

    qualname = "torch.Tensor"


def _rebuild_tensor_with_attributes(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch._tensor._rebuild_from_type_v2, restricted: megatron-core's tensors that carry
    Python attributes (`tensor_model_parallel`, ... copied onto Float16's fp32 main
    parameters) pickle through it. Only the plain tensor rebuild is called; the type
    must be the Tensor record and the attributes are dropped (bookkeeping
    megamoe never reads), so nothing from the file is set on an object."""
    if func is not torch._utils._rebuild_tensor_v2 or not (
            isinstance(new_type, type) and issubclass(new_type, _TensorType)):
        raise pickle.UnpicklingError("torch._tensor._rebuild_from_type_v2 of "
                                     f"{getattr(func, '__qualname__', type(func).__name__)}")
    return func(*args)


_ALLOWED = {
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_tensor_with_attributes,
    ("torch", "Tensor"): _TensorType,
    ("argparse", "Namespace"): argparse.Namespace,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("_codecs", "encode"): codecs.encode,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}
_NUMPY_RECONSTRUCT = {"numpy.core.multiarray", "numpy._core.multiarray"}


class _MegatronUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith("torch") and name.endswith("Storage"):
            return super().find_class(module, name)  # torch.load maps these to storages
        if module in _NUMPY_RECONSTRUCT and name == "_reconstruct":
            core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
            return core.multiarray._reconstruct
        if module == "megatron" or module.startswith("megatron.") or (
                (module, name) == ("_io", "BytesIO")):
            return type(name, (ForeignValue,), {"qualname": f"{module}.{name}"})
        raise pickle.UnpicklingError(f"{module}.{name}")


_PICKLE_MODULE = types.ModuleType("megamoe_megatron_pickle")
_PICKLE_MODULE.Unpickler = _MegatronUnpickler
_PICKLE_MODULE.load = pickle.load
_PICKLE_MODULE.__dict__.update(UnpicklingError=pickle.UnpicklingError)


def load_megatron_pickle(data: bytes, where: str) -> Any:
    """torch.load of `data` (a torch.save zip or a plain pickle) through the restricted
    unpickler; CheckpointError naming `where` if it names anything else or is damaged."""
    try:
        if not data.startswith(b"PK"):  # a plain pickle, not a torch.save zip
            return _MegatronUnpickler(io.BytesIO(data)).load()
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False,
                          pickle_module=_PICKLE_MODULE)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{where}: refused: its pickled common state names {e}, which "
                              "loading could run as code") from None
    except Exception as e:
        raise CheckpointError(f"{where}: cannot be read ({e.__class__.__name__})") from None


def load_megatron_torch_file(path: str) -> Any:
    """torch.load of a Megatron-LM legacy `model_optim_rng.pt` through the restricted
    unpickler, memory-mapped (the tensors are read when merged, not all up front);
    CheckpointError naming `path` if it names anything else, is damaged or truncated."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True,
                          pickle_module=_PICKLE_MODULE)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: it pickles {e}, which loading could run "
                              "as code") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e.__class__.__name__})"
                              ) from None
    except Exception as e:
        raise CheckpointError(f"{path}: cannot be read ({e.__class__.__name__}; truncated "
                              "or not a torch.save file)") from None


def read_byte_item(ckpt_dir: str, storage_data: dict, fqn: str
                   ) -> tuple[Optional[bytes], str]:
    """(the raw bytes of the DCP byte item `fqn`, the file they come from), located
    through DCP's index (`storage_data`, read by the restricted metadata unpickler);
    (None, ckpt_dir) if the index has no such item."""
    for index, info in storage_data.items():
        if getattr(index, "fqn", None) != fqn:
            continue
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(rel, str) and isinstance(offset, int) and isinstance(length, int)
                and offset >= 0 and 0 < length <= 2**31 and os.sep not in rel
                and not getattr(info, "transform_descriptors", None)):
            raise CheckpointError(f"{ckpt_dir}/.metadata: unusable index entry for {fqn}")
        path = os.path.join(ckpt_dir, rel)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
        if len(data) != length:
            raise CheckpointError(f"{path}: truncated ({fqn} needs bytes "
                                  f"{offset}..{offset + length})")
        return data, path
    return None, ckpt_dir


def read_common_bytes(ckpt_dir: str, storage_data: dict) -> tuple[bytes, str]:
    """(the raw bytes of the common state, the file they come from): the `common_state`
    byte item (read_byte_item), else the legacy common.pt."""
    data, path = read_byte_item(ckpt_dir, storage_data, COMMON_KEY)
    if data is not None:
        return data, path
    legacy = os.path.join(ckpt_dir, LEGACY_COMMON)
    if os.path.isfile(legacy):
        with open(legacy, "rb") as f:
            return f.read(), legacy
    raise CheckpointError(f"{ckpt_dir}: no Megatron common state ({COMMON_KEY} in the "
                          f"DCP files, or {LEGACY_COMMON})")


def read_megatron_common(ckpt_dir: str, storage_data: dict) -> dict:
    """The common state dict of a Megatron-LM torch_dist checkpoint directory (iter_N)."""
    data, where = read_common_bytes(ckpt_dir, storage_data)
    common = load_megatron_pickle(data, where)
    if isinstance(common, list) and len(common) == 1:  # the ShardedObject's one shard
        common = common[0]
    if not isinstance(common, dict):
        raise CheckpointError(f"{where}: the common state is not a dict "
                              f"({type(common).__name__})")
    if not isinstance(common.get("args"), argparse.Namespace):
        raise CheckpointError(f"{where}: no Megatron-LM `args` Namespace in the common state "
                              "(the model's shape is read from it)")
    return common
