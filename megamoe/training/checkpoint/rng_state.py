"""The RNG states a checkpoint saves and restores (python, numpy, torch CPU)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def reseed(seed: int, iteration: int, stream: int = 0) -> None:
    """After a layout change (RNG states not restorable): a fresh stream per resumed run
    (and pipeline stage, `stream`) that does not replay the first iterations' draws."""
    s = seed + iteration + stream
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
