"""A venv built once and cached (the test peers' and tools' own environments, never
megamoe's): `cached_python(root, key, build)` returns `root/key/bin/python`, calling
`build(final)` first if it is missing. The build holds a file lock (pytest-xdist workers
build it once) and is expected to make the venv elsewhere and rename it into place only
when it works, so a half-built venv is never used."""

from __future__ import annotations

import fcntl
import os
import subprocess
from typing import Callable


def cached_python(root: str, key: str, build: Callable[[str], None],
                  error: type[Exception]) -> str:
    """The cached venv's python; `error` (naming the venv) if building it fails."""
    return cached_path(root, key, build, error, os.path.join("bin", "python"))


def cached_path(root: str, key: str, build: Callable[[str], None],
                error: type[Exception], marker: str) -> str:
    """`root/key/marker`, calling `build(root/key)` first if that file is missing (a venv:
    marker bin/python; a `pip install --target` folder: the package's __init__.py)."""
    final = os.path.join(root, key)
    py = os.path.join(final, marker)
    if os.path.isfile(py):
        return py
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f"{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.isfile(py):
                build(final)
        except (OSError, subprocess.SubprocessError) as e:
            raise error(f"building {final} failed ({type(e).__name__}: {e})") from None
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return py
