"""Activation recompute that stays exact for MoE layers and tensor parallelism.

`checkpoint` is torch.utils.checkpoint (non-reentrant) plus what a MoE model needs:
- the tensor-parallel dropout streams (parallel/rng.py RNGTracker) are put back to where
  they were at the original forward before the replay, as torch does for its own
  generators, so dropout draws the same masks in the replay, on every TP rank;
- side effects happen once per real forward: code that counts (routing statistics, expert
  bias counts, loss logging) asks `is_recomputing()` and skips the replay; code whose
  result depends on state the forward advances (global_aux_loss's running counts and their
  all-reduce) wraps it in `replay_once`, which hands the replay the original result
  instead of running it again;
- routing decisions (the router's top-k, sinkhorn and expert-choice selections, the
  capacity drops) are `replay_once` results too: the replay recomputes the probabilities
  from its own logits but at the forward's choices, so a logit that differs in its last
  bit (another kernel, another reduction order) cannot send a token to another expert in
  the replay (other dispatch sizes, other all-to-all splits than the forward's);
- recomputation never stops early, so a replayed all-to-all runs on every rank of its group
  (torch's early stop could end the replay at a rank-dependent point).
Checkpoints do not nest: inside a checkpointed region (or its replay) a checkpoint or an
output discard is a plain call, since the outer region recomputes everything anyway.

`discard_saved` is Megatron's output-discarding checkpoint: the tensors that the consumers
of a cheap op's output save for backward are not kept; backward recomputes the output from
the op's inputs (kept anyway by the op itself), so no GEMM runs twice.

Evaluation and no-grad forwards run plainly: there is nothing to save.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import set_checkpoint_early_stop

from megamoe.parallel.rng import get_tracker_states, set_tracker_states


@dataclass
class _Region:
    """One checkpointed call: its RNG tracker states at the original forward, and the
    results `replay_once` recorded there (handed out in the same order in the replay)."""

    rng_states: dict
    started: bool = False
    replaying: bool = False
    log: list = field(default_factory=list)
    cursor: int = 0


_ACTIVE: list[_Region] = []  # the region running now (at most one: no nesting)


def is_recomputing() -> bool:
    """True while backward replays a checkpointed forward."""
    return bool(_ACTIVE) and _ACTIVE[0].replaying


def replay_once(fn: Callable[[], Any]) -> Any:
    """fn() at the real forward; in its replay, what that call returned."""
    if not _ACTIVE:
        return fn()
    region = _ACTIVE[0]
    if region.replaying:
        value = region.log[region.cursor]
        region.cursor += 1
        return value
    value = fn()
    region.log.append(value)
    return value


def _wants_checkpoint() -> bool:
    return torch.is_grad_enabled() and not _ACTIVE


def checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), keeping only the inputs for backward and rerunning fn there."""
    if not _wants_checkpoint():
        return fn(*args)
    region = _Region(get_tracker_states())

    def run(*inputs: Any) -> Any:
        region.replaying, region.started = region.started, True
        region.cursor = 0
        now = set_tracker_states(region.rng_states) if region.replaying else None
        _ACTIVE.append(region)
        try:
            return fn(*inputs)
        finally:
            _ACTIVE.pop()
            if now is not None:
                set_tracker_states(now)

    with set_checkpoint_early_stop(False):
        return torch_checkpoint(run, *args, use_reentrant=False)


@dataclass(frozen=True)
class _Discarded:
    """Where a saved tensor sat inside discarded output `index`."""

    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@contextlib.contextmanager
def discard_saved(output: torch.Tensor | Sequence[torch.Tensor],
                  recompute: Callable[[], Any]) -> Iterator[None]:
    """Inside: whatever autograd saves that is `output` or a view of it is dropped, and
    backward gets `recompute()` (run once, without gradients) in its place. `output` must
    be contiguous and `recompute()` must give it bit for bit (a deterministic op of kept
    inputs). `output` may be a sequence of tensors (one context: saved-tensor hooks do not
    nest); `recompute()` then returns them all, in order."""
    outputs = [output] if isinstance(output, torch.Tensor) else list(output)
    if not _wants_checkpoint() or any(o.numel() == 0 or not o.is_contiguous()
                                      for o in outputs):
        yield
        return
    # The hooks live as long as what they packed: they must not hold the outputs. A
    # storage is told by its StorageImpl (shared by every view), not its data pointer
    # (which fake and compiled tensors do not have).
    keys = [(o.untyped_storage()._cdata, o.storage_offset(), o.device, o.dtype)
            for o in outputs]
    cache: list[tuple[torch.Tensor, ...]] = []

    def pack(t: torch.Tensor) -> Any:
        for i, (ptr, base, device, dtype) in enumerate(keys):
            if t.device == device and t.dtype == dtype and t.untyped_storage()._cdata == ptr:
                return _Discarded(i, t.size(), t.stride(), t.storage_offset() - base)
        return t

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Discarded):
            return saved
        if not cache:
            with torch.no_grad():
                again = recompute()
            cache.append((again,) if isinstance(again, torch.Tensor) else tuple(again))
        again = cache[0][saved.index]
        return again.as_strided(saved.size, saved.stride, again.storage_offset() + saved.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def maybe_checkpoint(enabled: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """checkpoint(fn, *args) when `enabled` (and training with gradients), else fn(*args)."""
    return checkpoint(fn, *args) if enabled else fn(*args)


def maybe_discard(enabled: bool, output: torch.Tensor | Sequence[torch.Tensor],
                  recompute: Callable[[], Any]) -> contextlib.AbstractContextManager:
    """discard_saved(output, recompute) when `enabled`, else nothing."""
    return discard_saved(output, recompute) if enabled else contextlib.nullcontext()


__all__ = ["checkpoint", "discard_saved", "is_recomputing", "maybe_checkpoint",
           "maybe_discard", "replay_once"]
