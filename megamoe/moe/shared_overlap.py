"""--moe-shared-expert-overlap: the shared expert computes while the token dispatcher's
all-to-alls are in flight (Megatron-Core's SharedExpertMLP overlap, shared_experts.py).

One `SharedExpertOverlap` per layer call splits the shared expert into Megatron's two
halves, which the dispatcher runs where its communication waits:

  dispatcher: start dispatch all-to-all -> fc1()  -> wait -> experts ->
              start combine all-to-all  -> fc2()  -> wait -> combine
  layer:      routed output + output()

Both halves are the same modules and operations as the plain forward (SharedExpertMLP's
`fc1_forward` / `fc2_forward`), so the result is the same numbers; only the order of the
work changes. Dispatchers without asynchronous communication run the halves at the same
points, one after the other.

On a CUDA device the halves run on one side stream per device (Megatron's
`SharedExpertMLP.stream`): the side stream first waits for the default stream (the input
is ready), tensors crossing streams are `record_stream`ed so the caching allocator does
not reuse them early, and `output()` makes the default stream wait for the side stream.
Autograd runs each backward operation on its forward's stream and synchronises where a
gradient crosses streams. Elsewhere (CPU, gloo, the fake device of the tests) everything
runs in the same order on the one stream. In backward the halves' gradients are computed
while the gradient all-to-alls launched by the dispatcher's waits are in flight
(parallel/comm.py's asynchronous all-to-all), by autograd's own order: they were recorded
between each exchange's start and wait.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megamoe.moe.experts import SharedExpertMLP

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """The shared expert's stream on a CUDA device (one per device, made once); None
    elsewhere."""
    if device.type != "cuda":
        return None
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                          else device.index)
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


class SharedExpertOverlap:
    """One call's shared expert in two halves; call fc1(), fc2(), output() in order."""

    def __init__(self, mlp: SharedExpertMLP, x_TH: torch.Tensor) -> None:
        self.mlp, self.x_TH = mlp, x_TH
        self.stream = side_stream(x_TH.device)
        self._fc1_out: Optional[tuple] = None
        self._y_TH: Optional[torch.Tensor] = None

    def _on_side(self):
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def fc1(self) -> None:
        """fc1 + activation + gate score (under SP fc1 gathers the sequence first)."""
        if self._fc1_out is not None or self._y_TH is not None:
            raise RuntimeError("SharedExpertOverlap.fc1 called twice")
        if self.stream is not None:  # the input was made on the default stream
            self.stream.wait_stream(torch.cuda.current_stream(self.x_TH.device))
            self.x_TH.record_stream(self.stream)
        with self._on_side():
            self._fc1_out = self.mlp.fc1_forward(self.x_TH)

    def fc2(self) -> None:
        """fc2 (under SP it reduce-scatters to this rank's shard) and the gate."""
        if self._fc1_out is None:
            raise RuntimeError("SharedExpertOverlap.fc2 needs fc1 first")
        with self._on_side():
            self._y_TH = self.mlp.fc2_forward(*self._fc1_out)
        self._fc1_out = None

    def output(self) -> torch.Tensor:
        """The shared expert's output, usable on the default stream."""
        if self._y_TH is None:
            raise RuntimeError("SharedExpertOverlap.output needs fc1 and fc2 first")
        y_TH, self._y_TH = self._y_TH, None
        if self.stream is not None:
            current = torch.cuda.current_stream(y_TH.device)
            current.wait_stream(self.stream)
            y_TH.record_stream(current)  # made on the side stream, freed on this one
        return y_TH

