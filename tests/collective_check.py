"""What NCCL would refuse, checked on torch's fake process group.

The fake process group (torch.testing._internal.distributed.fake_pg) accepts any tensor:
a collective on a host tensor, or one whose ranks disagree on the dtype, passes there and
fails (or hangs) under NCCL. Every eager collective and point-to-point call of
torch.distributed reaches the dispatcher as a `c10d::` op (functional collectives as
`_c10d_functional::`), so a dispatch mode sees them all, whichever Python name issued
them. `CollectiveCheck(device)` asserts that every tensor of each such op is on the mesh
device and contiguous, and records the op and its dtypes in order: ranks run in separate
processes, so the caller compares their records (`same_on_every_rank`); NCCL needs the
same collectives with the same dtypes, in the same order, on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class CollectiveCheck(TorchDispatchMode):
    """Use as `with CollectiveCheck(mesh.device) as check:`; then `check.log`."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.log: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in NAMESPACES:
            tensors = _tensors(list(args) + list(kwargs.values()))
            name = func.name()
            for t in tensors:
                if t.device != self.device:
                    raise AssertionError(f"{name}: a tensor on {t.device}, the mesh device is "
                                         f"{self.device} (shape {tuple(t.shape)})")
                if not t.is_contiguous():
                    raise AssertionError(f"{name}: a non-contiguous tensor "
                                         f"(shape {tuple(t.shape)}, stride {t.stride()})")
            self.log.append((name, tuple(str(t.dtype) for t in tensors)))
        return func(*args, **kwargs)


def same_on_every_rank(logs: list[list]) -> None:
    """The ranks issued the same collectives, in the same order, with the same dtypes."""
    for rank, log in enumerate(logs[1:], start=1):
        for i, (a, b) in enumerate(zip(logs[0], log)):
            assert a == b, f"collective {i}: rank 0 issued {a}, rank {rank} {b}"
        assert len(log) == len(logs[0]), (f"rank 0 issued {len(logs[0])} collectives, "
                                          f"rank {rank} {len(log)}")
