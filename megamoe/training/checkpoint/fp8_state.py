"""Delayed FP8 scaling's amax histories and scales in torch_dist checkpoints, so a resume
is exact (issue 32): every rank's state (model/fp8/policy.py `Fp8State.state_dict`, host
copies taken at the save's iteration) is gathered into common.pt as "fp8", one entry per
rank, as the RNG states are. A load under the same layout restores this rank's entry
(checked for type, shape and range: `Fp8Meta.load_state`); a checkpoint without one (a
bf16 or tensor-wise run) or saved under another layout starts the scaling fresh (scale 1,
empty history: Transformer Engine's initial state), and the run says so.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn

from megamoe.training.checkpoint.safe_load import CheckpointError


def _state(model: nn.Module):
    state = getattr(model, "fp8_state", None)
    return state if state is not None and state.state_dict() else None


def gather_fp8_states(model: nn.Module, rank: int, world: int) -> Optional[list]:
    """Rank 0: [rank r's FP8 scaling state] (host tensors); other ranks None. None on every
    rank when the model has no delayed FP8 state (the same on every rank: one config)."""
    state = _state(model)
    if state is None:
        return None
    mine = {k: {n: t.detach().to("cpu", copy=True) for n, t in v.items()}
            for k, v in state.state_dict().items()}
    if world == 1:
        return [mine]
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered


def restore_fp8_state(model: nn.Module, common: dict, rank: int, same_layout: bool,
                      path: str) -> Optional[str]:
    """Load this rank's saved FP8 scaling into `model`; returns a line to print when the
    scaling starts fresh instead (None when restored or nothing to restore)."""
    state = _state(model)
    if state is None:
        return None
    saved = common.get("fp8")
    if saved is None:
        return "> the checkpoint has no FP8 delayed-scaling state: amax histories start empty"
    if not same_layout:
        return ("> checkpoint saved under another layout: FP8 amax histories start empty "
                "(the resume is not exact)")
    load_rank_entry(state, saved, rank, path, "fp8")
    return None


def load_rank_entry(state, saved: object, rank: int, path: str, key: str) -> None:
    """`state.load_state_dict(saved[rank])` where `saved` is common.pt's per-rank list
    under `key` (untrusted: its type and length are checked; a bad entry is a
    CheckpointError naming the file and the field, as load_state_dict reports it)."""
    if not isinstance(saved, list) or rank >= len(saved):
        raise CheckpointError(f"{path}: field '{key}' must hold one state per saved rank")
    try:
        state.load_state_dict(saved[rank], where=f"{key}[{rank}]")
    except ValueError as e:
        raise CheckpointError(f"{path}: field {e}") from None

