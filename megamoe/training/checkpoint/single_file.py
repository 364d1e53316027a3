"""--ckpt-format torch: one file (model, optimizer, scheduler, RNG, data position, args,
model config) written by rank 0, for single-process and data-parallel runs (the model is
replicated over data-parallel ranks, so rank 0 writes and every rank reads). Published
with the protocol of publish.py.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch

from megamoe.training.checkpoint.config_check import check_model_config
from megamoe.training.checkpoint.fields import check_fields
from megamoe.training.checkpoint.optim_fields import check_optimizer_state
from megamoe.training.checkpoint.publish import (
    FILENAME,
    KeepLast,
    checkpoint_file,
    discard_tmp,
    failure_message,
    fsync_dir,
    pause_point,
    prepare_tmp,
    publish_tmp,
    save_torch_file,
)
from megamoe.training.checkpoint.rng_state import rng_state, set_rng_state
from megamoe.training.checkpoint.safe_load import CheckpointError, load_torch_file
from megamoe.training.checkpoint.snapshot import snapshot


def build_state(iteration: int, model: torch.nn.Module, optimizer, scheduler,
                consumed_samples: int, args: dict, *, save_optim: bool = True,
                save_rng: bool = True, model_config: Optional[dict] = None) -> dict:
    """Everything one checkpoint holds (tensors still alias the live model)."""
    return {
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "args": args,
        "model_config": model_config,
        "model": model.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "optimizer": optimizer.state_dict() if save_optim and optimizer is not None else None,
        "rng": rng_state() if save_rng else None,
    }


def write_checkpoint(root: str, iteration: int, state: dict,
                     keep_last: KeepLast = None) -> str:
    """Publish `state` as iteration `iteration` under `root`; returns the directory. A
    failed write (OSError: full disk, permissions) removes the temporary directory and
    raises CheckpointError naming `root`; the previous checkpoint and pointer stay."""
    tmp = None
    try:
        tmp = prepare_tmp(root, iteration)
        pause_point("before_write", iteration)
        save_torch_file(state, os.path.join(tmp, FILENAME))
        fsync_dir(tmp)
        pause_point("after_write", iteration)
        return publish_tmp(root, iteration, tmp, keep_last)
    except BaseException as e:
        discard_tmp(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(failure_message(root, iteration, e, 0, 1)) from e
        raise


def save_checkpoint(root: str, iteration: int, model: torch.nn.Module, optimizer, scheduler,
                    consumed_samples: int, args: dict, *, save_optim: bool = True,
                    save_rng: bool = True, model_config: Optional[dict] = None,
                    keep_last: KeepLast = None) -> str:
    """Write iteration `iteration` under `root` (blocking); returns the published directory."""
    state = build_state(iteration, model, optimizer, scheduler, consumed_samples, args,
                        save_optim=save_optim, save_rng=save_rng, model_config=model_config)
    return write_checkpoint(root, iteration, state, keep_last)


class AsyncCheckpointWriter:
    """--async-save: snapshot the state on the caller's thread (a memory copy), then
    serialise, fsync and publish it on a background thread while training continues.

    At most one save is in flight: the next `save` and `finalize` join the previous one and
    re-raise its error (CheckpointError), so a failed write is never silently lost.
    """

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def save(self, root: str, iteration: int, state: dict,
             keep_last: KeepLast = None) -> None:
        self.finalize()
        state = snapshot(state)  # this iteration's values, whatever training does next

        def run() -> None:
            try:
                write_checkpoint(root, iteration, state, keep_last)
            except BaseException as e:  # surfaced by finalize() on the training thread
                self._error = e

        self._thread = threading.Thread(target=run, name=f"async-save-{iteration}",
                                        daemon=False)
        self._thread.start()

    def finalize(self) -> None:
        """Wait for the in-flight save (if any); raise CheckpointError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, CheckpointError):  # write_checkpoint's one line
                raise CheckpointError(str(e)) from e
            raise CheckpointError(f"async save failed: {e}") from e


def read_single_file(file: str) -> dict:
    """A single-file checkpoint's state on CPU; CheckpointError (naming the file) if it is
    unreadable, refused (safe_load.py) or not a megamoe checkpoint."""
    state = load_torch_file(file)  # refuses anything but megamoe's own types (safe_load.py)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{file}: not a megamoe checkpoint (no model weights)")
    check_fields(file, state)
    state["_file"] = file
    return state


def load_checkpoint(root: str, model: torch.nn.Module, optimizer, scheduler, *,
                    load_optim: bool = True, load_rng: bool = True,
                    finetune: bool = False) -> tuple[int, int]:
    """Load the latest checkpoint under `root` into model/optimizer/scheduler.

    Returns (iteration, consumed samples); (0, 0) when there is no checkpoint (training
    starts from scratch, as Megatron does) or with --finetune (weights only).
    """
    found = checkpoint_file(root) if os.path.exists(root) else None
    if found is None:
        return 0, 0
    state = read_single_file(found)
    path = state["_file"]
    check_model_config(path, state.get("model_config"), getattr(model, "config", None))
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()
        detail = first[1].strip() if len(first) > 1 else first[0]
        raise CheckpointError(f"{path}: does not match the model ({detail})") from None
    if optimizer is not None:
        if load_optim and not finetune and state.get("optimizer") is not None:
            check_optimizer_state(path, state["optimizer"], optimizer)
            optimizer.load_state_dict(state["optimizer"])
        else:
            optimizer.reload_model_params()
    if finetune:
        return 0, 0
    if scheduler is not None and load_optim and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if load_rng and state.get("rng") is not None:
        set_rng_state(state["rng"])
    return int(state["iteration"]), int(state["consumed_train_samples"])
