"""The compiled greedy blending loop (blend_helper.c), built on first use, loaded by ctypes.

Why compiled: the greedy "largest error" rule is a sequential scan (each pick changes
the next position's errors), so NumPy cannot vectorise it exactly; as a Python loop it
costs 0.65 s per million samples, 6-7 minutes for a DeepSeek-V3-sized run, on every
uncached start. The C loop does the same IEEE double operations in the same order
(-ffp-contract=off: no fused multiply-subtract), so its output is identical.

Like Megatron-LM's helpers.cpp it is compiled on the machine that runs it, with the
system C compiler, once per source version: into $MEGAMOE_HELPER_DIR, else
~/.cache/megamoe, else the temporary directory, written under a temporary name and
renamed, so concurrent ranks are safe. Without a compiler `load()` returns None and
callers fall back to the Python loop (with a warning).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Optional

import numpy as np

from megamoe.data.atomic import remove_quietly, tmp_path_for

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "blend_helper.c")
_FLAGS = ["-O2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
_loaded: dict[str, Optional[Callable]] = {}


def _library_dirs() -> list[str]:
    dirs = [os.environ.get("MEGAMOE_HELPER_DIR", ""),
            os.path.join(os.path.expanduser("~"), ".cache", "megamoe"),
            os.path.join(tempfile.gettempdir(), f"megamoe-{os.getuid()}")]
    return [d for d in dirs if d]


def _library_name() -> str:
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    return f"blend_helper-{digest}-{platform.machine()}.so"


def _compile(path: str) -> None:
    found = shutil.which("cc") or shutil.which("gcc")
    compiler = shlex.split(os.environ.get("CC", "")) or ([found] if found else [])
    if not compiler:
        raise OSError("no C compiler (cc/gcc) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tmp_path_for(path)
    try:
        subprocess.run([*compiler, *_FLAGS, "-o", tmp, _SOURCE], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, path)
    except subprocess.CalledProcessError as e:
        raise OSError(f"{compiler[0]} failed: {e.stderr.decode(errors='replace')[-300:]}") from e
    finally:
        remove_quietly(tmp)


def _bind(path: str) -> Callable:
    fn = ctypes.CDLL(path).megamoe_blend
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]
    fn.restype = None
    return fn


def load() -> Optional[Callable]:
    """The C function megamoe_blend, compiling it if no library is cached; None (after one
    warning) when it cannot be built or loaded here."""
    name = _library_name()
    if name in _loaded:
        return _loaded[name]
    errors = []
    for d in _library_dirs():
        path = os.path.join(d, name)
        try:
            if not os.path.isfile(path):
                _compile(path)
            _loaded[name] = _bind(path)
            return _loaded[name]
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{d}: {e}")
    sys.stderr.write("megamoe.data: warning: cannot build the blending helper "
                     f"({'; '.join(errors)}); using the slow Python loop\n")
    _loaded[name] = None
    return None


def blend_chunk(fn: Callable, weights_K: np.ndarray, start: int, dataset_index: np.ndarray,
                sample_index: np.ndarray, counts_K: np.ndarray) -> None:
    """Positions start .. start + len(dataset_index) into the two (contiguous) outputs;
    `counts_K` (int64, per dataset before `start`) is advanced in place."""
    assert weights_K.dtype == np.float64 and counts_K.dtype == np.int64
    assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64
    assert dataset_index.flags.c_contiguous and sample_index.flags.c_contiguous
    assert len(dataset_index) == len(sample_index) and len(weights_K) == len(counts_K)
    fn(weights_K.ctypes.data, len(weights_K), start, len(dataset_index),
       dataset_index.ctypes.data, sample_index.ctypes.data, counts_K.ctypes.data)
