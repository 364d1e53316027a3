"""The FP8 recipe object and autocast context of the --fp8-* flags, for TE's modules.

As Megatron-Core's get_fp8_recipe / get_fp8_context (megatron/core/fp8_utils.py): the format
is Format.E4M3 or Format.HYBRID; `delayed` is DelayedScaling(margin, fp8_format,
amax_history_len, amax_compute_algo), `tensorwise` Float8CurrentScaling(fp8_format),
`blockwise` Float8BlockScaling(fp8_format), `mxfp8` MXFP8BlockScaling(fp8_format); each
transformer layer's forward runs inside TE's autocast with that recipe and the amax
reduction group (TP x DP x CP, TP x CP with --tp-only-amax-red). TE's `autocast(enabled,
recipe, amax_reduction_group)` is used where the installed TE has it, else the older
`fp8_autocast(enabled, fp8_recipe=, fp8_group=)` (TE v2.18 has both, the latter
deprecated). Which recipes a run may choose is config/fp8.py's decision, not this file's.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, ContextManager, Optional

import torch.distributed as dist

from megamoe.config import ConfigError
from megamoe.config.fp8 import Fp8Config
from megamoe.model.te.loader import TransformerEngine

RECIPE_CLASSES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
                   "blockwise": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling"}
_FORMATS = {"e4m3": "E4M3", "hybrid": "HYBRID"}


def fp8_recipe(te: TransformerEngine, config: Fp8Config):
    """TE's recipe object for `config` (FP8 enabled)."""
    if config.recipe not in RECIPE_CLASSES:
        raise ValueError(f"not supported yet: --fp8-recipe {config.recipe} with "
                         "--transformer-impl transformer_engine")
    fmt = getattr(te.recipe.Format, _FORMATS[config.format])
    cls = getattr(te.recipe, RECIPE_CLASSES[config.recipe])
    if config.recipe == "delayed":
        extra = {}
        if not config.fp8_wgrad:  # Megatron: override_linear_precision=(False, False, True)
            if "override_linear_precision" not in _init_parameters(cls):
                raise ConfigError("not supported yet: --no-fp8-wgrad with --transformer-impl "
                                 "transformer_engine: this Transformer Engine's "
                                 "DelayedScaling has no override_linear_precision (v2.18's "
                                 "has none)")
            extra["override_linear_precision"] = (False, False, True)
        return cls(margin=config.margin, fp8_format=fmt,
                   amax_history_len=config.amax_history_len,
                   amax_compute_algo=config.amax_compute_algo, **extra)
    return cls(fp8_format=fmt)


def _init_parameters(cls) -> set[str]:
    """The keyword names a recipe class's constructor takes (a dataclass: its fields)."""
    try:
        return set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return set()


def autocast_factory(te: TransformerEngine, config: Fp8Config,
                     group: Optional[dist.ProcessGroup]) -> Callable[[], ContextManager]:
    """A function giving a fresh TE autocast context for one layer's forward (FP8 under
    `config`'s recipe), or a null context when FP8 is off."""
    if not config.enabled:
        return contextlib.nullcontext
    recipe = fp8_recipe(te, config)
    autocast = getattr(te.pytorch, "autocast", None)
    if autocast is not None:
        return lambda: autocast(enabled=True, recipe=recipe, amax_reduction_group=group)
    return lambda: te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)
