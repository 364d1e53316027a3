"""Transformer Engine's `_extra_state` in torch_dist checkpoints (model/te/extra_state.py):
every rank's TE extra states (host copies taken at the save's iteration) are gathered into
common.pt as "te_extra_state", one dict per rank, as the FP8 scaling states are
(fp8_state.py). A TE run loading under the same layout restores its rank's entry (checked
for type, names and size); a checkpoint without one (a `local` run's) or saved under
another layout leaves TE's initial state, and the run says so. A `local` run ignores the
entry: the parameters are the same either way, so checkpoints move freely between the
two implementations.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn

from megamoe.training.checkpoint.fp8_state import load_rank_entry

KEY = "te_extra_state"


def gather_te_states(model: nn.Module, rank: int, world: int) -> dict:
    """{KEY: [rank r's extra states]} on rank 0 ({} on every rank without TE modules; other
    ranks' values are None)."""
    state = getattr(model, "te_state", None)
    if state is None or not state.modules:
        return {}
    mine = state.state_dict()  # host copies: a snapshot
    if world == 1:
        return {KEY: [mine]}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return {KEY: gathered}


def restore_te_state(model: nn.Module, common: dict, rank: int, same_layout: bool,
                     path: str) -> Optional[str]:
    """Load this rank's saved TE extra state into `model`; returns a line to print when TE
    starts from its initial state instead (None when restored or nothing to restore)."""
    state = getattr(model, "te_state", None)
    if state is None or not state.modules:
        return None
    saved = common.get(KEY)
    if saved is None:
        return ("> the checkpoint has no Transformer Engine extra state (a local run's): TE "
                "starts from its initial FP8 state")
    if not same_layout:
        return ("> checkpoint saved under another layout: Transformer Engine's extra state "
                "starts fresh (the resume is not exact)")
    load_rank_entry(state, saved, rank, path, KEY)
    return None
