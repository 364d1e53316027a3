"""Record a real run's device->host reads, replay them under a fake device.

The MoE dispatch path has data-dependent sizes: `nonzero` (the permutation's rows) and
`Tensor.tolist()` (split sizes, a backend's host group sizes) are its only host reads
(tests/moe/test_host_syncs.py holds that). A fake tensor has no values, so a fake-device
run cannot make them; HostReads records them, in order, from a real CPU run of the same
model, routing and layout, and hands them back to the fake run at the same points:
nonzero gets a fake tensor of the recorded shape on its input's device, tolist the
recorded list. Everything else runs the real code on the fake device, so a tensor made on
the host by mistake, or a host read where none was recorded, still fails.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """`HostReads()` records; `HostReads(log)` replays `log`. Use `with reads.active():`."""

    def __init__(self, log: Optional[list[tuple[str, Any]]] = None) -> None:
        super().__init__()
        self.recording = log is None
        self.log: list[tuple[str, Any]] = [] if log is None else list(log)

    def _next(self, kind: str) -> Any:
        if not self.log:
            raise AssertionError(f"a host read ({kind}) the real run did not make")
        got, value = self.log.pop(0)
        if got != kind:
            raise AssertionError(f"host read {kind} where the real run made {got}")
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nonzero.default:
            if self.recording:
                out = func(*args, **(kwargs or {}))
                self.log.append(("nonzero", tuple(out.shape)))
                return out
            shape = self._next("nonzero")
            return torch.zeros(shape, dtype=torch.long, device=args[0].device)
        return func(*args, **(kwargs or {}))

    def _tolist(self, original):
        def tolist(t: torch.Tensor):
            if self.recording:
                value = original(t)
                self.log.append(("tolist", value))
                return value
            return self._next("tolist")
        return tolist

    @contextlib.contextmanager
    def active(self) -> Iterator[HostReads]:
        """This mode, with Tensor.tolist (a C++ method no dispatch mode sees on the CPU)
        and FakeTensor.tolist routed through the log."""
        original = torch.Tensor.tolist
        own = {cls: cls.__dict__.get("tolist") for cls in (torch.Tensor, FakeTensor)}
        for cls in own:
            cls.tolist = self._tolist(original)
        try:
            with self:
                yield self
        finally:  # put back exactly what each class had (or had not) itself
            for cls, method in own.items():
                if method is None:
                    del cls.tolist
                else:
                    cls.tolist = method
