"""NVIDIA apex's fused kernels, used only when their CUDA extensions load.

apex's Python package imports fine without its CUDA extensions (a plain `pip install` of
NVIDIA/apex builds none of them), and then fails late, in the middle of a run. At the
pinned NVIDIA/apex commit 6424da3b4faa6c8f062da4a48c424fff3f02d42d:

- apex/normalization/fused_layer_norm.py: `fused_layer_norm_affine` and
  `fused_rms_norm_affine` import the extension `fused_layer_norm_cuda` inside their first
  forward (`importlib.import_module`), and call its `forward_affine` /
  `rms_forward_affine`;
- apex/optimizers/fused_adam.py: `FusedAdam.__init__` raises "apex.optimizers.FusedAdam
  requires cuda extensions" unless `multi_tensor_applier.available`, which
  apex/multi_tensor_apply/multi_tensor_apply.py sets by importing the extension `amp_C`;
  it then reads `amp_C.multi_tensor_adam`, `_capturable` and `_capturable_master`.

So the probe imports those extensions and checks those names. It runs once per process,
lazily, and only on a GPU path (a CPU run never imports apex); when apex cannot serve, it
writes one line saying why, and the callers use torch's kernels (same math).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable, Optional

_NORM_EXTENSION = ("fused_layer_norm_cuda", ("forward_affine", "rms_forward_affine"))
_ADAM_EXTENSION = ("amp_C", ("multi_tensor_adam", "multi_tensor_adam_capturable",
                             "multi_tensor_adam_capturable_master"))


@dataclass(frozen=True)
class ApexKernels:
    """What apex can run here (None: use torch's), and why not for the rest."""

    fused_adam: Optional[type] = None
    fused_layer_norm_affine: Optional[Callable] = None
    fused_rms_norm_affine: Optional[Callable] = None
    problems: tuple[str, ...] = ()


def _extension_problem(name: str, attrs: tuple[str, ...]) -> Optional[str]:
    """Why the compiled extension `name` cannot serve (None: it can)."""
    try:
        module = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - missing, ABI or CUDA mismatch: all mean "absent"
        return f"its CUDA extension {name} does not import ({type(e).__name__}: {e})"
    missing = [a for a in attrs if not hasattr(module, a)]
    return f"its CUDA extension {name} lacks {', '.join(missing)}" if missing else None


def _norms() -> tuple[Optional[Callable], Optional[Callable], Optional[str]]:
    try:  # NVIDIA apex (built from NVIDIA's repository; PyPI's "apex" is another package)
        from apex.normalization.fused_layer_norm import (
            fused_layer_norm_affine,
            fused_rms_norm_affine,
        )
    except Exception as e:  # noqa: BLE001 - absent, or another package of that name
        return None, None, f"apex.normalization does not import ({type(e).__name__}: {e})"
    problem = _extension_problem(*_NORM_EXTENSION)
    if problem:
        return None, None, f"apex's fused norms: {problem}"
    return fused_layer_norm_affine, fused_rms_norm_affine, None


def _fused_adam() -> tuple[Optional[type], Optional[str]]:
    try:
        from apex.optimizers import FusedAdam
    except Exception as e:  # noqa: BLE001 - absent, or another package of that name
        return None, f"apex.optimizers does not import ({type(e).__name__}: {e})"
    problem = _extension_problem(*_ADAM_EXTENSION)
    return (None, f"apex's FusedAdam: {problem}") if problem else (FusedAdam, None)


_PROBED: Optional[ApexKernels] = None  # (a plain global: torch.compile reads it as is)


def apex_kernels() -> ApexKernels:
    """What apex can run here: probed at the first call (one import attempt and at most
    one line per process)."""
    global _PROBED
    if _PROBED is None:
        _PROBED = _probe()
    return _PROBED


def _probe() -> ApexKernels:
    if "apex" not in sys.modules and importlib.util.find_spec("apex") is None:
        sys.stderr.write("megamoe: warning: NVIDIA apex not installed, torch's kernels run "
                         "instead\n")
        return ApexKernels(problems=("apex is not installed",))
    ln, rms, norm_problem = _norms()
    adam, adam_problem = _fused_adam()
    problems = tuple(p for p in (norm_problem, adam_problem) if p)
    if problems:
        sys.stderr.write("megamoe: warning: torch's kernels run instead of NVIDIA apex's: "
                         f"{'; '.join(problems)}\n")
    return ApexKernels(adam, ln, rms, problems)
