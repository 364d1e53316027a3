"""Write-then-rename helpers so a killed process never leaves a half-written file."""

from __future__ import annotations

import os
import uuid
from typing import Optional

import numpy as np


def tmp_path_for(path: str) -> str:
    """A unique sibling of `path` (same filesystem, so the final rename is atomic)."""
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def publish(tmp_path: str, path: str) -> None:
    """Flush `tmp_path` to disk and atomically move it over `path`."""
    with open(tmp_path, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp_path, path)


def remove_quietly(path: Optional[str]) -> None:
    if path is not None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def save_npy_atomic(path: str, array: np.ndarray) -> None:
    """np.save through a temporary file; concurrent writers (several ranks) are safe."""
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
        publish(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
