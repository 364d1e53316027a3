"""Single-process checkpoints in Megatron's directory layout, written atomically.

    SAVE/iter_0000100/model_optim_rng.pt
    SAVE/latest_checkpointed_iteration.txt      ("100")

One file holds the model, optimizer (fp32 main params + states), LR scheduler, RNG states,
the data position (consumed samples) and the arguments. The model is replicated across
data-parallel ranks, so rank 0 writes and every rank reads. A save is written into a
temporary directory and published with a rename; the pointer file is replaced last, also by
rename, so a process killed at any moment leaves the previous checkpoint loadable.
(Sharded torch.distributed.checkpoint saves that reshard across layouts are a later
feature: --ckpt-format torch_dist is rejected as not supported yet.)
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Optional

import numpy as np
import torch

TRACKER = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"


class CheckpointError(Exception):
    """A checkpoint that cannot be read or does not fit the model (message names the file)."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: str, iteration: int, model: torch.nn.Module, optimizer, scheduler,
                    consumed_samples: int, args: dict, *, save_optim: bool = True,
                    save_rng: bool = True) -> str:
    """Write iteration `iteration` under `root`; returns the published directory."""
    os.makedirs(root, exist_ok=True)
    state = {
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "args": args,
        "model": model.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "optimizer": optimizer.state_dict() if save_optim and optimizer is not None else None,
        "rng": _rng_state() if save_rng else None,
    }
    final = iteration_dir(root, iteration)
    tmp = f"{final}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    path = os.path.join(tmp, FILENAME)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(final):  # re-saving an iteration: swap, never leave it missing
        old = f"{final}.old.{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _atomic_write_text(os.path.join(root, TRACKER), f"{iteration}\n")
    return final


def read_tracker(root: str) -> Optional[int]:
    """The latest published iteration, or None when `root` holds no checkpoint yet."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


def load_checkpoint(root: str, model: torch.nn.Module, optimizer, scheduler, *,
                    load_optim: bool = True, load_rng: bool = True,
                    finetune: bool = False) -> tuple[int, int]:
    """Load the latest checkpoint under `root` into model/optimizer/scheduler.

    Returns (iteration, consumed samples); (0, 0) when there is no checkpoint (training
    starts from scratch, as Megatron does) or with --finetune (weights only).
    """
    iteration = read_tracker(root)
    if iteration is None:
        return 0, 0
    path = os.path.join(iteration_dir(root, iteration), FILENAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (named by {os.path.join(root, TRACKER)})")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # any unpickling failure means a damaged file
        raise CheckpointError(f"{path}: cannot be read ({e.__class__.__name__})") from None
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()
        detail = first[1].strip() if len(first) > 1 else first[0]
        raise CheckpointError(f"{path}: does not match the model ({detail})") from None
    if optimizer is not None:
        if load_optim and not finetune and state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])
        else:
            optimizer.reload_model_params()
    if finetune:
        return 0, 0
    if scheduler is not None and load_optim and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if load_rng and state.get("rng") is not None:
        _set_rng_state(state["rng"])
    return int(state["iteration"]), int(state["consumed_train_samples"])
