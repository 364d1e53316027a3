"""A seeded fuzz of the fields a checkpoint file carries (issue 26): every non-tensor value
(and every small tensor) reachable in common.pt, in the single file's state and in a DCP
.metadata is, one at a time, replaced by a value of another type or out of range, or
deleted, and `pretrain_gpt.py --load` of the result either resumes (the value was valid)
or stops with one line and exit 1: never a traceback, never a hang.

The default suite runs a small sample of each file kind; the slow set a larger seeded sample
(every leaf against every replacement is some 2,000 resumes: about 40 minutes here). A
failing case prints its file, path and replacement, so it can be rerun alone with the
same seed."""

from __future__ import annotations

import math
import os
import pickle
import random
import shlex
import shutil
from typing import Any, Iterator, Optional

import pytest
import torch

from megamoe.cli.main import main
from tests.training.test_pretrain import TINY_MOE

# Replacement values: wrong types, out of range, non-finite, huge, empty, non-UTF-8 bytes.
REPLACEMENTS: list[Any] = [
    "abc", -1, 2**70, float("nan"), float("inf"), 1.5, None, True, [], {}, (),
    b"\xff\xfe", torch.tensor(float("nan")), torch.zeros(3, dtype=torch.int64),
]
DELETE = "<deleted>"
LARGEST_TENSOR = 64  # tensors with more elements are weights (the DCP shards test those)


def _leaves(obj: Any, path: tuple = ()) -> Iterator[tuple]:
    """Paths (keys / indices) to every leaf a fuzz may replace: non-tensor values, small
    tensors, and each dict key (for deletion)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield path + (k,)
            if isinstance(v, (dict, list, tuple)) or _small_tensor(v):
                yield from _leaves(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield path + (i,)
            yield from _leaves(v, path + (i,))


def _small_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.numel() <= LARGEST_TENSOR


def _replaced(obj: Any, path: tuple, value: Any) -> Any:
    """A copy of `obj` (containers rebuilt along `path`) with the leaf at `path`
    replaced (or, for DELETE in a dict, removed)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        out = dict(obj)
        if value is DELETE and not rest:
            out.pop(head)
        else:
            out[head] = _replaced(obj[head], rest, value)
        return out
    items = list(obj)
    items[head] = _replaced(items[head], rest, None if value is DELETE else value)
    return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)


def _cases(state: dict, n: int, seed: int) -> list[tuple[tuple, Any]]:
    everything = [(p, r) for p in _leaves(state) for r in REPLACEMENTS + [DELETE]
                  if not (r is DELETE and isinstance(p[-1], int))]
    if n >= len(everything):
        return everything
    return random.Random(seed).sample(everything, n)


def _describe(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return type(value).__name__ if value is not DELETE else DELETE


def _one(saved_root: str, tmp: str, name: str, path: tuple, value: Any, capsys
         ) -> Optional[str]:
    """None if the run resumed or stopped in one line with exit 1; else what happened."""
    root = os.path.join(tmp, "ckpt")
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(saved_root, root)
    target = os.path.join(root, "iter_0000001", name)
    if name == ".metadata":
        with open(target, "rb") as f:
            meta = pickle.load(f)  # our own test file
        meta = _set_metadata(meta, path, value)
        with open(target, "wb") as f:
            pickle.dump(meta, f)
    else:
        state = torch.load(target, map_location="cpu", weights_only=False)  # our own file
        torch.save(_replaced(state, path, value), target)
    capsys.readouterr()
    case = f"{name} {path!r} <- {_describe(value)}"
    try:
        code = main(shlex.split(f"{TINY_MOE} --train-iters 2 --load {root} --eval-iters 0"))
    except BaseException as e:  # noqa: BLE001 (what the fuzz looks for)
        return f"{case}: {type(e).__name__}: {e}"
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if code not in (0, 1) or (code == 1 and (len(lines) != 1 or "Traceback" in err)):
        return f"{case}: exit {code}: {err[-300:]}"
    return None


def _fuzz(saved_root: str, tmp: str, name: str, cases, capsys) -> None:
    failures = [f for path, value in cases
                if (f := _one(saved_root, tmp, name, path, value, capsys)) is not None]
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


def _metadata_leaves(meta) -> dict[str, Any]:
    """The .metadata's storage entries and tensor properties as a dict the fuzz can edit
    (dataclasses flattened by field name)."""
    return {"storage_data": dict(meta.storage_data or {}),
            "state_dict_metadata": dict(meta.state_dict_metadata)}


def _set_metadata(meta, path: tuple, value: Any):
    """Replace a field of the DCP Metadata dataclasses along `path` (read from
    `_metadata_leaves`), or the dataclass itself where `path` ends on it."""
    tree = _metadata_leaves(meta)
    edited = _replaced(tree, path, value)
    meta.storage_data = edited["storage_data"]
    meta.state_dict_metadata = edited["state_dict_metadata"]
    return meta


def _metadata_cases(saved_root: str, n: int, seed: int) -> list[tuple[tuple, Any]]:
    with open(os.path.join(saved_root, "iter_0000001", ".metadata"), "rb") as f:
        meta = pickle.load(f)  # our own test file
    tree = _metadata_leaves(meta)
    paths = [p for p in _leaves(tree) if len(p) == 2]  # each entry, replaced whole
    rng = random.Random(seed)
    everything = [(p, r) for p in paths for r in REPLACEMENTS + [DELETE]]
    return everything if n >= len(everything) else rng.sample(everything, n)


KINDS = {"single": ("torch", "model_optim_rng.pt"), "common": ("torch_dist", "common.pt")}


def _state(saved_root: str, name: str) -> dict:
    return torch.load(os.path.join(saved_root, "iter_0000001", name), map_location="cpu",
                      weights_only=False)  # our own test file


@pytest.mark.parametrize("kind", list(KINDS))
def test_fuzzed_fields_resume_or_stop_in_one_line(checkpoints, tmp_path, capsys, kind):
    fmt, name = KINDS[kind]
    cases = _cases(_state(checkpoints[fmt], name), n=5, seed=20261125)
    _fuzz(checkpoints[fmt], str(tmp_path), name, cases, capsys)


def test_fuzzed_metadata_entries_resume_or_stop_in_one_line(checkpoints, tmp_path, capsys):
    _fuzz(checkpoints["torch_dist"], str(tmp_path), ".metadata",
          _metadata_cases(checkpoints["torch_dist"], n=4, seed=20261125), capsys)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_more_fields_fuzzed(checkpoints, tmp_path, capsys, kind):
    fmt, name = KINDS[kind]
    cases = _cases(_state(checkpoints[fmt], name), n=80, seed=0)
    _fuzz(checkpoints[fmt], str(tmp_path), name, cases, capsys)


@pytest.mark.slow
def test_more_metadata_entries_fuzzed(checkpoints, tmp_path, capsys):
    _fuzz(checkpoints["torch_dist"], str(tmp_path), ".metadata",
          _metadata_cases(checkpoints["torch_dist"], n=40, seed=0), capsys)
