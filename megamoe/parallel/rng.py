"""Tensor-parallel-aware RNG for dropout (Megatron's "model-parallel-rng" tracker).

Two streams per rank:
- the default generator, seeded `seed + 100 * pp_rank`: identical on every TP rank of a
  stage, so dropout on *replicated* activations (hidden dropout without sequence
  parallelism) draws the same mask everywhere and the replicas stay equal;
- the tracker's stream, seeded `seed + 2718 + tp_rank`: different on every TP rank, used
  for dropout on *split* activations (attention heads of this rank, sequence shards), so
  no two shards share a mask.
pretrain.build_model seeds both after the (layout-independent) weight init. One process
with TP = PP = 1 never forks and keeps the plain `torch.manual_seed` stream, so its results
are unchanged; every layout is reproducible for a given seed.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Optional

import torch

MODEL_PARALLEL_SEED_OFFSET = 2718
PIPELINE_SEED_STRIDE = 100


_TRACKERS: weakref.WeakSet[RNGTracker] = weakref.WeakSet()


class RNGTracker:
    """A saved CPU (and CUDA) RNG state that `fork()` swaps in and out."""

    def __init__(self, seed: int):
        _TRACKERS.add(self)
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        torch.manual_seed(seed)
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state() if saved_cuda is not None else None
        torch.set_rng_state(saved_cpu)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        outer_cpu = torch.get_rng_state()
        outer_cuda = torch.cuda.get_rng_state() if self._cuda is not None else None
        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state(self._cuda)
        try:
            yield
        finally:
            self._cpu = torch.get_rng_state()
            torch.set_rng_state(outer_cpu)
            if self._cuda is not None:
                self._cuda = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(outer_cuda)


TrackerStates = dict[RNGTracker, tuple[torch.Tensor, Optional[torch.Tensor]]]


def get_tracker_states() -> TrackerStates:
    """Every live tracker's stream position (copies), for activation recompute: torch's
    checkpoint replays its own generators, not these."""
    return {t: (t._cpu.clone(), None if t._cuda is None else t._cuda.clone())
            for t in list(_TRACKERS)}


def set_tracker_states(states: TrackerStates) -> TrackerStates:
    """Put the trackers back to `states`; returns where they were."""
    now = get_tracker_states()
    for tracker, (cpu, cuda) in states.items():
        tracker._cpu, tracker._cuda = cpu.clone(), None if cuda is None else cuda.clone()
    return now
