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
    block; afterwards neither is, as on this machine without TE, and TE's attention
    switches (NVTE_*_ATTN, which a TE build sets) are as before."""
    for name in _te_modules():
        del sys.modules[name]
    saved_env = {k: v for k, v in os.environ.items() if k.startswith("NVTE_")}
    sys.path.insert(0, DIR)
    importlib.invalidate_caches()
    try:
        yield importlib.import_module("transformer_engine.pytorch")
    finally:
        sys.path.remove(DIR)
        for name in _te_modules():
            del sys.modules[name]
        for k in [k for k in os.environ if k.startswith("NVTE_")]:
            del os.environ[k]
        os.environ.update(saved_env)
