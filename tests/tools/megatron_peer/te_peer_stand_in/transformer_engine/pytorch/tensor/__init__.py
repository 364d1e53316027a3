"""transformer_engine.pytorch.tensor: megatron-core's fp8_utils imports QuantizedTensor
(TE >= 2.0) for isinstance checks; nothing here is ever one."""

import torch


class QuantizedTensor(torch.Tensor):
    pass
