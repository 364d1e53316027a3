"""megamoe: Megatron-style Mixture-of-Experts GPT pretraining in PyTorch.

The public names resolve lazily, so `import megamoe.config` (or the data tools) does not
import the training stack; the package itself sits above every layer
(docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "MoEConfig": "megamoe.config",
    "MoELayer": "megamoe.moe.layer",
    "from_checkpoint": "megamoe.inference",
    "moefy": "megamoe.model.moefy",
    "parallelize": "megamoe.parallelize",
    "routing_stats": "megamoe.moe.stats",
    "upcycle_model": "megamoe.model.moefy",
}
__all__ = ["MoEConfig", "MoELayer", "from_checkpoint", "moefy", "parallelize", "routing_stats",
           "upcycle_model"]

if TYPE_CHECKING:
    from megamoe.config import MoEConfig
    from megamoe.inference import from_checkpoint
    from megamoe.model.moefy import moefy, upcycle_model
    from megamoe.moe.layer import MoELayer
    from megamoe.moe.stats import routing_stats
    from megamoe.parallelize import parallelize


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
