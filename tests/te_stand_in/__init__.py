"""The Transformer Engine stand-in (this directory, put on sys.path by `installed`): see
transformer_engine/__init__.py here for what it reproduces from TE v2.18."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

DIR = os.path.dirname(os.path.abspath(__file__))


def _te_modules() -> list[str]:
    return [n for n in sys.modules if n == "transformer_engine_torch"
            or n == "transformer_engine" or n.startswith("transformer_engine.")]


@contextlib.contextmanager
def installed():
    """The stand-in importable as `transformer_engine` (and its extension) inside the
    block; afterwards neither is, as on this machine without TE."""
    for name in _te_modules():
        del sys.modules[name]
    sys.path.insert(0, DIR)
    importlib.invalidate_caches()
    try:
        yield importlib.import_module("transformer_engine.pytorch")
    finally:
        sys.path.remove(DIR)
        for name in _te_modules():
            del sys.modules[name]
