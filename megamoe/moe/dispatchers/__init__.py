"""Token dispatchers: how an MoE layer's token copies reach its experts (base.py)."""

from megamoe.moe.dispatchers.adaptive import PARALLEL_MODES, AdaptiveDispatcher
from megamoe.moe.dispatchers.allgather import AllGatherDispatcher
from megamoe.moe.dispatchers.alltoall import AllToAllDispatcher
from megamoe.moe.dispatchers.base import TokenDispatcher
from megamoe.moe.dispatchers.expert_parallel import ExpertParallelDispatcher
from megamoe.moe.dispatchers.local import LocalDispatcher
from megamoe.moe.dispatchers.tensor_parallel import TensorParallelDispatcher

__all__ = ["PARALLEL_MODES", "AdaptiveDispatcher", "AllGatherDispatcher",
           "AllToAllDispatcher", "ExpertParallelDispatcher", "LocalDispatcher",
           "TensorParallelDispatcher", "TokenDispatcher"]
