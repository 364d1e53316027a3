"""Reading checkpoint files without running code that a checkpoint could carry.

A checkpoint is often downloaded from somewhere else. Python's pickle, which torch.save
and torch.distributed.checkpoint (DCP) use for everything that is not raw tensor bytes,
calls any importable function the file names while it loads; a crafted `common.pt`,
`model_optim_rng.pt` or DCP `.metadata` would run code the moment megamoe opened it. So
every unpickling on megamoe's load path admits only the types megamoe itself writes:

- torch.save files (`model_optim_rng.pt`, `common.pt`): `torch.load(weights_only=True)`
  (tensors, numbers, strings, containers) plus numpy's array reconstruction, which the
  numpy RNG state in the saved RNG states needs;
- DCP's `.metadata`: a restricted unpickler that knows DCP's metadata dataclasses,
  torch.Size, dtypes and layouts, and nothing else (`SafeFileSystemReader`);
- DCP's byte items (arbitrary pickled objects a DCP checkpoint may hold): never read;
  megamoe asks DCP for tensors only, and `TensorOnlyLoadPlanner` refuses bytes outright.

Anything else fails with `CheckpointError` naming the file, before any of it runs.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re
from typing import Any

import numpy as np
import torch
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


class CheckpointError(Exception):
    """A checkpoint that cannot be read or does not fit the model (message names the file)."""


def _numpy_reconstruct():
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    return core.multiarray._reconstruct


# What megamoe's own torch.save files hold besides weights_only's defaults: the numpy
# MT19937 state of the saved RNG states (an ndarray of uint32).
_TORCH_SAVE_GLOBALS = [_numpy_reconstruct(), np.ndarray, np.dtype, type(np.dtype(np.uint32))]

# What DCP's FileSystemWriter pickles into `.metadata`.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # megatron-core's torch_dist saves keep the global save plan in the metadata
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}

_REFUSED = ("refused: it holds pickled objects other than a checkpoint's tensors, numbers, "
            "strings and RNG states, and loading it could run code ({})")


def load_torch_file(path: str) -> Any:
    """torch.load of a megamoe torch.save file on the CPU, admitting only megamoe's types."""
    try:
        with torch.serialization.safe_globals(_TORCH_SAVE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if named is None:  # not a forbidden callable: a damaged file
            raise CheckpointError(f"{path}: cannot be read (UnpicklingError)") from None
        raise CheckpointError(f"{path}: {_REFUSED.format(named.group(1))}") from None
    except Exception as e:  # any other unpickling failure means a damaged file
        raise CheckpointError(f"{path}: cannot be read ({e.__class__.__name__})") from None


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only DCP's metadata types (and dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")


def read_dcp_metadata(path: str) -> dcp_metadata.Metadata:
    """Unpickle a DCP `.metadata` file with `_MetadataUnpickler`; CheckpointError if it
    names anything else or is not DCP metadata."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: {_REFUSED.format(e)}") from None
    except Exception as e:
        raise CheckpointError(f"{path}: cannot be read ({e.__class__.__name__})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: not DCP metadata ({type(metadata).__name__})")
    return metadata


def confined_storage(ckpt_dir: str, storage_data: Any) -> None:
    """Each `.metadata` storage entry names a file DCP wrote into `ckpt_dir` itself (a
    plain file name, resolving inside the directory) at a non-negative offset and length:
    a crafted `../x` or absolute path, or a file that is a symlink out of the directory,
    would make the load read another file. CheckpointError naming `.metadata` otherwise
    (the offending name is not quoted)."""
    where = os.path.join(ckpt_dir, ".metadata")
    if not isinstance(storage_data, dict):
        raise CheckpointError(f"{where}: storage entries must be a dict")
    root = os.path.realpath(ckpt_dir)
    checked: set[str] = set()
    for info in storage_data.values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(rel, str) and all(isinstance(v, int) and not isinstance(v, bool)
                                             and v >= 0 for v in (offset, length))):
            raise CheckpointError(f"{where}: a storage entry is not a file name, offset "
                                  "and length")
        if rel in checked:
            continue
        inside = os.path.realpath(os.path.join(root, rel))
        if (os.path.basename(rel) != rel or rel in ("", ".", "..") or os.path.isabs(rel)
                or os.path.dirname(inside) != root):
            raise CheckpointError(f"{where}: a storage entry names a file outside the "
                                  "checkpoint directory; refused")
        checked.add(rel)


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader whose `.metadata` goes through `read_dcp_metadata`. (Tensor
    items are read by DCP with torch.load(weights_only=True) already.)"""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_dcp_metadata(os.path.join(str(self.path), name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: dcp_metadata.Metadata, *args: Any,
                              **kwargs: Any) -> None:
        """(Every rank, before any data is read.) The storage entries `read_data` will
        open stay inside the checkpoint directory (confined_storage)."""
        confined_storage(str(self.path), metadata.storage_data)
        super().set_up_storage_reader(metadata, *args, **kwargs)


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that a byte item (an arbitrary pickled object, which
    DCP would torch.load with weights_only=False) is refused, never unpickled."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise CheckpointError(f"{read_item.dest_index.fqn}: refused a pickled (non-tensor) "
                              "item; megamoe checkpoints hold tensors only")
