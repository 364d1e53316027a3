"""The RNG states a checkpoint saves and restores: python, numpy, torch's CPU generator and,
on a GPU, this rank's CUDA generator (dropout on the device draws from it)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's, a CPU byte tensor
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reseed(seed: int, iteration: int, stream: int = 0) -> None:
    """After a layout change (RNG states not restorable): a fresh stream per resumed run
    (and pipeline stage, `stream`) that does not replay the first iterations' draws.
    (torch.manual_seed seeds the CUDA generators too.)"""
    s = seed + iteration + stream
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
