"""MkDocs' Python: a venv of its own with the `docs` extra's packages (pinned), built once
and cached under ~/.cache/megamoe/docs-venv/<pins>, so `mkdocs build --strict` runs in CI
without the developer installing `.[docs]` (megamoe's own venv stays as README sets it up).

mkdocstrings reads megamoe's sources statically (griffe), so the venv needs no torch. The
build holds a file lock (pytest-xdist workers build it once) and is renamed into place only
after `mkdocs --version` works, so a half-built venv is never used."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.cached_venv import cached_python

PINS = ["mkdocs-material==9.8.2", "mkdocstrings[python]==1.0.8",
        "mkdocstrings-python==2.0.11"]
KEY = "mkdocs-material9.8.2-mkdocstrings1.0.8-python2.0.11"
ROOT = os.path.join(os.path.expanduser(os.environ.get("MEGAMOE_CACHE", "~/.cache/megamoe")),
                    "docs-venv")


class DocsVenvUnavailable(RuntimeError):
    """The docs venv cannot be built here (no package index); the message says why."""


def _build(final: str) -> None:
    tmp = f"{final}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log = f"{final}.log"
    subprocess.run([sys.executable, "-m", "venv", tmp], check=True)
    for cmd in ([os.path.join(tmp, "bin", "python"), "-m", "pip", "install", "-q", *PINS],
                [os.path.join(tmp, "bin", "python"), "-m", "mkdocs", "--version"]):
        with open(log, "a") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1200)
        if done.returncode != 0:
            raise DocsVenvUnavailable(f"`{' '.join(cmd[1:4])} ...` failed; see {log}")
    os.replace(tmp, final)


def mkdocs() -> list[str]:
    """The command running the cached venv's mkdocs, building the venv first if needed
    (`python -m mkdocs`: the venv's scripts name the temporary folder it was built in)."""
    return [cached_python(ROOT, KEY, _build, DocsVenvUnavailable), "-m", "mkdocs"]
