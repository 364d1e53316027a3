"""Whole training steps under CUDA's sync debug mode "error" (issue 27 item 3 on a GPU).

`torch.cuda.set_sync_debug_mode("error")` makes every synchronising CUDA call raise:
a `.item()`, a device->host copy, a `nonzero`, a blocking host->device copy. megamoe's
training step makes a few such reads on purpose (docs/gpu-path.md, "Host reads per
training step"); `SanctionedReads` lets exactly those through, counts them by file, and
leaves every other synchronising call to raise, with the traceback naming its line.

The mode is switched on at the second `train_step` (the first may build caches, exchange
which stage logs which layer, and so on) and off when the training loop returns, so it
spans whole steps: forward, backward, optimizer, the loop's bookkeeping and its logging.
Without CUDA (the CPU rehearsal) nothing raises, but the sanctioned reads are counted
the same way, so the expected counts are checked on the CPU too. A check that counts
nothing fails: it would mean the hooks no longer see the reads, not that there are none.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megamoe.training.loop as loop

# The reads a training step makes on purpose: file -> why (docs/gpu-path.md).
SANCTIONED = {
    "megamoe/moe/permute.py": "the dropless dispatch's token counts (nonzero), once per "
                              "MoE layer and micro-batch, as Megatron",
    "megamoe/moe/dispatchers/alltoall.py": "the all-to-all's split sizes (EP > 1)",
    "megamoe/moe/grouped_gemm.py": "group sizes for a grouped-GEMM backend that takes "
                                   "them on the host",
    "megamoe/training/nonfinite.py": "the step's verdict: grad norm, NaN/Inf, overflow",
    "megamoe/training/host_read.py": "a logging iteration's one batched read",
}
LOGGED = "megamoe/training/host_read.py"


def _site() -> str:
    """The innermost megamoe file on the stack ("" if none)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/megamoe/" in path:
            return "megamoe/" + path.rsplit("/megamoe/", 1)[1]
        frame = frame.f_back
    return ""


class SanctionedReads:
    """`with SanctionedReads() as reads:` -> reads.counts ({file: n}), reads.steps."""

    def __init__(self, warmup_steps: int = 1) -> None:
        self.counts: Counter[str] = Counter()
        self.steps = 0
        self.warmup_steps = warmup_steps
        self.cuda = torch.cuda.is_available()
        self._calls = 0
        self._stack: contextlib.ExitStack | None = None
        self._saved: dict[str, object] = {}

    @contextlib.contextmanager
    def _let_through(self, site: str) -> Iterator[None]:
        self.counts[site] += 1
        previous = torch.cuda.get_sync_debug_mode() if self.cuda else 0
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.set_sync_debug_mode(previous)

    def _tolist(self, original):
        reads = self

        def tolist(t: torch.Tensor):
            site = _site()
            if site not in SANCTIONED:
                return original(t)  # under "error" a device tensor's read raises here
            with reads._let_through(site):
                return original(t)
        return tolist

    def _start(self) -> None:
        reads = self

        class _Nonzero(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is torch.ops.aten.nonzero.default:
                    site = _site()
                    if site in SANCTIONED:
                        with reads._let_through(site):
                            return func(*args, **kwargs)
                return func(*args, **kwargs)

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_Nonzero())
        original = torch.Tensor.tolist
        torch.Tensor.tolist = self._tolist(original)
        self._stack.callback(self._restore_tolist)
        if self.cuda:
            torch.cuda.synchronize()  # what came before is not the steps' business
            torch.cuda.set_sync_debug_mode("error")
            self._stack.callback(torch.cuda.set_sync_debug_mode, 0)

    @staticmethod
    def _restore_tolist() -> None:
        if "tolist" in vars(torch.Tensor):
            delattr(torch.Tensor, "tolist")

    def _stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def __enter__(self) -> SanctionedReads:
        step, train_loop = loop.train_step, loop._train_loop
        self._saved = {"train_step": step, "_train_loop": train_loop}

        def counted_step(*args, **kwargs):
            self._calls += 1
            if self._calls == self.warmup_steps + 1:
                self._start()
            if self._stack is not None:
                self.steps += 1
            return step(*args, **kwargs)

        def bounded_loop(*args, **kwargs):
            try:
                return train_loop(*args, **kwargs)
            finally:
                self._stop()

        loop.train_step, loop._train_loop = counted_step, bounded_loop
        return self

    def __exit__(self, *exc) -> None:
        self._stop()
        for name, value in self._saved.items():
            setattr(loop, name, value)


def verdict(counts: dict[str, int], steps: int, per_step: dict[str, int]) -> list[str]:
    """What is wrong with these counts (empty: nothing). Each file in `per_step` must be
    read exactly per_step x steps times; a logging iteration's batched read at most once
    a step; any other sanctioned file not at all (it was not expected in this run)."""
    problems = []
    if steps == 0 or sum(counts.values()) == 0:
        problems.append(f"counted nothing over {steps} steps: the hooks saw no read")
    for site, n in per_step.items():
        if counts.get(site, 0) != n * steps:
            problems.append(f"{site}: {counts.get(site, 0)} reads, expected {n} x {steps}")
    for site, got in counts.items():
        if site in per_step:
            continue
        limit = steps if site == LOGGED else 0
        if got > limit:
            problems.append(f"{site}: {got} reads, expected at most {limit}")
    return problems
