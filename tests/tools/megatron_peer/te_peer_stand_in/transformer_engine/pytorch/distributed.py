"""transformer_engine.pytorch.distributed as megatron-core imports it: the RNG tracker
base class (megatron-core's TECudaRNGStatesTracker subclasses it at import; the peer uses
megatron-core's own tracker) and activation_recompute_forward (imported by
tensor_parallel/random.py; used only by its FP8-aware recompute)."""


class CudaRNGStatesTracker:
    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("the peer's TE stand-in has no CUDA RNG tracker")


def activation_recompute_forward(*args, **kwargs):
    raise NotImplementedError("the peer's TE stand-in has no TE activation recompute")


def set_tensor_model_parallel_attributes(tensor, is_parallel: bool, dim: int,
                                         stride: int) -> None:
    """TE 27486e03 pytorch/distributed.py lines 150-163: refuses a tensor that has them."""
    for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(tensor, attribute):
            raise RuntimeError(f"Tensor already has attribute '{attribute}' set.")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride
