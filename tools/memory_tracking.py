"""Peak bytes of the tensors a piece of code allocates, measured on CPU.

`torch.cuda.max_memory_allocated` has no CPU counterpart, so `TensorMemoryTracker` (a
TorchDispatchMode) accounts storages itself: every tensor an operator returns whose storage
is not one of the operator's inputs' storages (views, in-place and out= results, collectives
writing into their arguments are not allocations) and not already tracked is a new
allocation of `untyped_storage().nbytes()` bytes; a weakref finalizer on the storage takes
the bytes off again when it is freed. `live` is what the code allocated and still holds,
`peak` the maximum of `live` while the mode was active: the transient memory of the code on
top of what existed before it.

What it sees: every tensor created through the dispatcher on this thread (factory
functions, copies, results of arithmetic, tensors made by torch.distributed.checkpoint's
planner and writer on the calling thread). What it does not see: memory that is not a
tensor (Python bytes, the file writer's buffers), allocations inside a backend's C++ code
that do not go through the dispatcher (gloo's internal scratch), and other threads (DCP's
background writer of an async save). The same blind spots apply before and after a change,
so comparisons are like for like.

`ops` records each collective (c10d) call as (name, [(dtype, numel) of its tensors]).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The plain tensors in `tree`; a wrapper subclass (DTensor) counts as its inner tensors
    (the mode runs before the subclass, so it sees the DTensor, not its local ops)."""
    out, todo = [], [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    while todo:
        t = todo.pop()
        if is_traceable_wrapper_subclass(t):
            inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
            todo.extend(x for x in inner if isinstance(x, torch.Tensor))
        else:
            out.append(t)
    return out


class TensorMemoryTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest: dict[torch.dtype, int] = {}  # the largest single allocation per dtype
        self.ops: list[tuple[str, list[tuple[torch.dtype, int]]]] = []
        self._tracked: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if func.namespace == "c10d":
            self.ops.append((func.__name__, [(t.dtype, t.numel()) for t in inputs]))
        sources = {t.untyped_storage().data_ptr() for t in inputs}
        out = func(*args, **kwargs)
        for t in _tensors(out):
            storage = t.untyped_storage()
            key, nbytes = id(storage), storage.nbytes()
            if nbytes == 0 or key in self._tracked or storage.data_ptr() in sources:
                continue
            self._tracked.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), nbytes)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def allocator_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes the CPU allocator holds for `fn()` on top of what was held before, from
    the profiler's allocation events: unlike `TensorMemoryTracker` it sees allocations
    inside a kernel's C++ code (an attention kernel's scratch tiles), freed before the
    kernel returns. (Uses the autograd profiler's raw event list, `kineto_results`: the
    per-operator totals net an allocation freed within the same operator to zero; and
    that profiler directly, as `torch.profiler.profile` first imports torch._inductor:
    30 s on two busy cores.)"""
    from torch.autograd.profiler import profile

    with profile(use_cpu=True, profile_memory=True) as prof:
        fn()
    events = [e for e in prof.kineto_results.events() if e.name() == "[memory]"
              and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak
