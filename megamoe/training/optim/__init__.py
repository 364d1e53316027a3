"""Optimizers: fp32 main parameters (mixed_precision.py), ZeRO-1 sharding
(distributed.py, over the flat param / grad buffers of flat_shards.py), gradient reduction
and norms (grads.py)."""

from megamoe.training.optim.build import build_optimizer
from megamoe.training.optim.distributed import DistributedOptimizer
from megamoe.training.optim.mixed_precision import MixedPrecisionOptimizer

__all__ = ["DistributedOptimizer", "MixedPrecisionOptimizer", "build_optimizer"]
