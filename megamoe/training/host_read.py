"""One batched device->host read of every value a logging iteration shows.

On a GPU each `.item()`/`float(t)`/`.tolist()` waits for the device to catch up with the
host, so the training loop keeps the per-step statistics (losses, expert load, the
heatmap's counts) as device tensors and reads all of them here, in one copy, only on the
iterations that log them (Megatron's training_log likewise accumulates its loss dict on
the device and reads it at the log line).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def read_all(containers: list[dict[Any, Any]]) -> None:
    """Replace every tensor value in `containers` (dicts, changed in place) by its host
    value: a 0-d tensor by a float, a larger one by a float64 numpy array of its
    shape. All of them are read in ONE device->host copy (a float64 concatenation, exact
    for fp32/bf16 values and for integer counts below 2**53; one per device, should a
    value live elsewhere); a tensor held by several containers is copied once."""
    unique: dict[int, torch.Tensor] = {}
    for d in containers:
        for v in d.values():
            if isinstance(v, torch.Tensor):
                unique.setdefault(id(v), v)
    if not unique:
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in unique.values():  # one device in a run; a host-side value would be a second
        by_device.setdefault(t.device, []).append(t)
    host: dict[int, Any] = {}
    for tensors in by_device.values():
        values = torch.cat([t.detach().reshape(-1).to(torch.float64)
                            for t in tensors]).tolist()
        offset = 0
        for t in tensors:
            n = t.numel()
            host[id(t)] = (values[offset] if t.dim() == 0
                           else np.array(values[offset:offset + n]).reshape(t.shape))
            offset += n
    for d in containers:
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                d[k] = host[id(v)]
