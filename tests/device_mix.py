"""A device mix that torch's fake tensors let through and a GPU does not.

FakeTensorMode rejects `meta_tensor + cpu_tensor` but accepts the in-place form
`meta_tensor += cpu_tensor` (and `out=` forms): its common-device check skips an op's
mutated argument. On a GPU both fail ("Expected all tensors to be on the same device"),
unless the CPU tensor is a 0-d scalar. `DeviceMix()` is a dispatch mode that holds every
aten op but the copies (copy_, to, _to_copy: moving data between devices is their job)
to CUDA's rule: every tensor argument with a dimension on one device.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from tests.collective_check import _tensors

_MOVES = {"copy_", "_to_copy", "to", "_copy_from", "_copy_from_and_resize", "lift_fresh",
          "lift_fresh_copy", "_has_compatible_shallow_copy_type", "set_"}


class DeviceMix(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "aten" and func.__name__.split(".")[0] not in _MOVES:
            devices = {t.device for t in _tensors(list(args) + list(kwargs.values()))
                       if t.dim() > 0}
            if len(devices) > 1:
                raise AssertionError(f"{func}: tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)
