"""Importing Transformer Engine (TE) only when it can run.

TE's Python package can be present while its compiled torch extension is not (the PyPI
`transformer-engine` meta package, or the `core_cu*` wheel, installs `transformer_engine`
without `transformer_engine_torch`, and `transformer_engine.pytorch` then fails on import
deep inside, with a long traceback). So the probe imports the extension module
`transformer_engine_torch` first, then `transformer_engine.pytorch` and
`transformer_engine.common.recipe`, and turns any failure into one line naming the package
(`TransformerEngineMissing`): the command line prints it and exits 1 before any process
group, data index or allocation exists.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

PACKAGE = "transformer_engine"
EXTENSION = "transformer_engine_torch"  # TE's compiled torch extension (a top-level module)


class TransformerEngineMissing(RuntimeError):
    """--transformer-impl transformer_engine and TE cannot be imported here."""


@dataclass(frozen=True)
class TransformerEngine:
    """The imported modules: `pytorch` (transformer_engine.pytorch) and `recipe`
    (transformer_engine.common.recipe)."""

    pytorch: ModuleType
    recipe: ModuleType


def _import(name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - absent, ABI or CUDA mismatch: all mean "cannot run"
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TransformerEngineMissing(
            f"--transformer-impl transformer_engine needs the Python package "
            f"transformer_engine with its PyTorch extension ({what} {name} does not import: "
            f"{type(e).__name__}: {detail}); install transformer-engine[pytorch] or use "
            "--transformer-impl local") from None


def load_transformer_engine() -> TransformerEngine:
    """TE's pytorch and recipe modules, or TransformerEngineMissing (one line). Imports are
    cached by Python, so calling it again costs nothing."""
    _import(EXTENSION, "its compiled extension")
    pytorch = _import(f"{PACKAGE}.pytorch", "the module")
    recipe = _import(f"{PACKAGE}.common.recipe", "the module")
    return TransformerEngine(pytorch, recipe)
