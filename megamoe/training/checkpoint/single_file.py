"""Checkpoints in Megatron's directory layout, written crash-safely.

    SAVE/iter_0000100/model_optim_rng.pt         --ckpt-format torch (single file)
    SAVE/iter_0000100/{.metadata,*.distcp,common.pt}   --ckpt-format torch_dist (default;
                                                 sharded, any layout: dist_checkpoint.py)
    SAVE/latest_checkpointed_iteration.txt      ("100")

This module holds the single-file format and the publish protocol both formats share.

One file holds the model, optimizer (fp32 main params + states), LR scheduler, RNG states,
the data position (consumed samples), the arguments and the model config (enough to rebuild
the model without the command line: `megamoe.from_checkpoint`). The model is replicated
across data-parallel ranks, so rank 0 writes and every rank reads.

Publish protocol (a process killed at any instant leaves the last complete checkpoint
loadable and the pointer valid):
  1. write + fsync `iter_N.tmp.PID/model_optim_rng.pt`
  2. rename it to `iter_N` (re-saving N: `iter_N` -> `iter_N.old.PID` first; readers fall
     back to that copy while `iter_N` is missing)
  3. replace the pointer file by rename
  4. retention (--ckpt-keep-last): rename old `iter_M` to `iter_M.del.PID`, then delete;
     never the one the pointer names
Leftovers of a killed save (`*.tmp.*`, `*.old.*`, `*.del.*`) are cleaned by the next save.
Loading detects the format from the directory's contents, whatever --ckpt-format says.
"""

from __future__ import annotations

import glob
import os
import random
import re
import shutil
import threading
import time
from typing import Any, Optional

import numpy as np
import torch

from megamoe.training.checkpoint.safe_load import CheckpointError, load_torch_file

TRACKER = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"
COMMON = "common.pt"  # torch_dist: rank 0's non-tensor state, written after the shards
# Test hook for the crash tests: "PHASE:ITERATION:MARKER" makes the writer create MARKER and
# sleep when the save of ITERATION reaches PHASE, so a test can SIGKILL it at a known point
# of the publish protocol.
PAUSE_ENV = "MEGAMOE_CKPT_TEST_PAUSE"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _pause_point(phase: str, iteration: int) -> None:
    spec = os.environ.get(PAUSE_ENV, "").split(":", 2)
    if len(spec) == 3 and spec[0] == phase and spec[1] == str(iteration):
        open(spec[2], "w").close()
        time.sleep(3600)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


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
        "rng": _rng_state() if save_rng else None,
    }


def _clean_leftovers(root: str) -> None:
    """Remove what killed saves left; restore an `iter_N.old.*` whose `iter_N` is missing."""
    for old in glob.glob(os.path.join(root, "iter_*.old.*")):
        final = old.split(".old.")[0]
        if not os.path.exists(final):
            os.replace(old, final)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for pattern in ("iter_*.tmp.*", "iter_*.del.*", f"{TRACKER}.tmp.*"):
        for path in glob.glob(os.path.join(root, pattern)):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


def list_checkpoints(root: str) -> list[int]:
    """Published iterations under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    found = [int(m.group(1)) for m in map(_ITER_RE.match, os.listdir(root)) if m]
    return sorted(i for i in found if _is_checkpoint_dir(iteration_dir(root, i)))


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, FILENAME)) or os.path.isfile(
        os.path.join(path, COMMON))


def prune_checkpoints(root: str, keep_last: int, *, _saving: int = -1) -> list[int]:
    """Delete all but the newest `keep_last` checkpoints, never the one the pointer names.

    Each victim is first renamed out of the `iter_N` namespace, so a crash mid-delete never
    leaves a half-deleted directory that looks like a checkpoint. Returns deleted iterations.
    """
    keep = set(list_checkpoints(root)[-keep_last:])
    latest = read_tracker(root)
    if latest is not None:
        keep.add(latest)
    deleted = []
    for it in list_checkpoints(root):
        if it in keep:
            continue
        doomed = f"{iteration_dir(root, it)}.del.{os.getpid()}"
        os.replace(iteration_dir(root, it), doomed)
        _pause_point("prune", _saving)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(it)
    return deleted


def prepare_tmp(root: str, iteration: int) -> str:
    """Step 0 of a save (one writer): clean what killed saves left, make the tmp dir."""
    os.makedirs(root, exist_ok=True)
    _clean_leftovers(root)
    tmp = f"{iteration_dir(root, iteration)}.tmp.{os.getpid()}"
    os.makedirs(tmp)
    return tmp


def write_checkpoint(root: str, iteration: int, state: dict,
                     keep_last: Optional[int] = None) -> str:
    """Publish `state` as iteration `iteration` under `root`; returns the directory."""
    tmp = prepare_tmp(root, iteration)
    _pause_point("before_write", iteration)
    with open(os.path.join(tmp, FILENAME), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    _pause_point("after_write", iteration)
    return publish_tmp(root, iteration, tmp, keep_last)


def publish_tmp(root: str, iteration: int, tmp: str, keep_last: Optional[int] = None) -> str:
    """Steps 2-4: publish the complete `tmp` as iteration `iteration`, then the pointer,
    then retention. Returns the published directory."""
    final = iteration_dir(root, iteration)
    if os.path.exists(final):  # re-saving an iteration: swap, never leave it unreadable
        old = f"{final}.old.{os.getpid()}"
        os.replace(final, old)
        _pause_point("mid_swap", iteration)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    _pause_point("after_publish", iteration)
    _atomic_write_text(os.path.join(root, TRACKER), f"{iteration}\n")
    _pause_point("after_tracker", iteration)
    if keep_last:
        prune_checkpoints(root, keep_last, _saving=iteration)
    return final


def save_checkpoint(root: str, iteration: int, model: torch.nn.Module, optimizer, scheduler,
                    consumed_samples: int, args: dict, *, save_optim: bool = True,
                    save_rng: bool = True, model_config: Optional[dict] = None,
                    keep_last: Optional[int] = None) -> str:
    """Write iteration `iteration` under `root` (blocking); returns the published directory."""
    state = build_state(iteration, model, optimizer, scheduler, consumed_samples, args,
                        save_optim=save_optim, save_rng=save_rng, model_config=model_config)
    return write_checkpoint(root, iteration, state, keep_last)


def _snapshot(obj: Any) -> Any:
    """Deep copy of every tensor, so training can go on mutating the originals."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return obj


class AsyncCheckpointWriter:
    """--async-save: snapshot the state on the caller's thread (a memory copy), then
    serialise, fsync and publish it on a background thread while training continues.

    At most one save is in flight: the next `save` and `finalize` join the previous one and
    re-raise its error, so a failed write is never silently lost.
    """

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def save(self, root: str, iteration: int, state: dict,
             keep_last: Optional[int] = None) -> None:
        self.finalize()
        snapshot = _snapshot(state)

        def run() -> None:
            try:
                write_checkpoint(root, iteration, snapshot, keep_last)
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
            raise CheckpointError(f"async save failed: {e}") from e


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


def _in_dir(path: str) -> Optional[str]:
    """The single file, or the torch_dist directory itself, a checkpoint directory holds."""
    if os.path.isfile(os.path.join(path, FILENAME)):
        return os.path.join(path, FILENAME)
    if os.path.isfile(os.path.join(path, COMMON)):
        return path
    return None


def checkpoint_file(path: str) -> Optional[str]:
    """`path` (a --save root, an iter_N directory or the file) -> what to read: the
    single file, or for torch_dist the iter_N directory.

    None when `path` is a root without a checkpoint yet. While a re-save is mid-swap the
    pointer's `iter_N` may be briefly missing; its `iter_N.old.*` copy is read instead.
    """
    if os.path.isfile(path):
        return path
    if _in_dir(path) is not None:
        return _in_dir(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    iteration = read_tracker(path)
    if iteration is None:
        if glob.glob(os.path.join(path, ".metadata")) or glob.glob(os.path.join(path, "*.distcp")):
            raise CheckpointError(f"{path}: incomplete torch_dist checkpoint (no {COMMON})")
        return None
    found = _in_dir(iteration_dir(path, iteration))
    if found is None:
        for old in sorted(glob.glob(iteration_dir(path, iteration) + ".old.*")):
            if _in_dir(old) is not None:
                return _in_dir(old)
        raise CheckpointError(f"{iteration_dir(path, iteration)}: missing or incomplete "
                              f"(named by {os.path.join(path, TRACKER)})")
    return found


def is_dist_checkpoint(found: str) -> bool:
    """`found` (from checkpoint_file) names a torch_dist directory."""
    return os.path.isdir(found)


def read_checkpoint(path: str) -> dict:
    """Load a checkpoint's state on CPU; CheckpointError (naming the file) if unreadable."""
    file = checkpoint_file(path)
    if file is None:
        raise CheckpointError(f"{os.path.join(path, TRACKER)}: missing (no checkpoint in {path})")
    if is_dist_checkpoint(file):
        from megamoe.training.checkpoint.dist import read_dist_checkpoint

        return read_dist_checkpoint(file)
    state = load_torch_file(file)  # refuses anything but megamoe's own types (safe_load.py)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{file}: not a megamoe checkpoint (no model weights)")
    state["_file"] = file
    return state


# ModelConfig fields that decide parameter shapes, with the flag that sets each.
_SHAPE_FIELDS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels",
    "padded_vocab_size": "the tokenizer's vocabulary / --make-vocab-size-divisible-by",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "swiglu": "--swiglu", "add_bias_linear": "--disable-bias-linear",
    "position_embedding_type": "--position-embedding-type",
}
_MOE_SHAPE_FIELDS = {"num_experts": "--num-experts", "ffn_hidden_size": "--moe-ffn-hidden-size"}


def _check_model_config(file: str, saved: Optional[dict], config: Any) -> None:
    """Name the first flag whose value differs from the checkpoint's (shape-relevant only)."""
    if not saved or config is None or not hasattr(config, "num_layers"):
        return
    mine = dict(vars(config), padded_vocab_size=config.padded_vocab_size)
    if "padded_vocab_size" not in saved:
        m = saved.get("make_vocab_size_divisible_by", 1)
        saved = dict(saved, padded_vocab_size=-(-saved["vocab_size"] // m) * m)
    all_moe = bool(config.moe) and all(config.moe_layer_pattern or [])
    for name, flag in _SHAPE_FIELDS.items():
        if name == "ffn_hidden_size" and all_moe:
            continue  # no dense MLP to size
        if name in saved and saved[name] != mine.get(name):
            raise CheckpointError(f"{file}: checkpoint has {name}={saved[name]} but this run "
                                  f"has {mine.get(name)} ({flag})")
    saved_moe, my_moe = saved.get("moe") or {}, vars(config.moe) if config.moe else {}
    for name, flag in _MOE_SHAPE_FIELDS.items():
        a, b = saved_moe.get(name), my_moe.get(name)
        if a != b:
            raise CheckpointError(f"{file}: checkpoint has {name}={a} but this run has {b} "
                                  f"({flag})")
    if saved.get("moe_layer_pattern") != mine.get("moe_layer_pattern"):
        raise CheckpointError(f"{file}: checkpoint's MoE layers {saved.get('moe_layer_pattern')}"
                              f" differ from this run's (--moe-layer-freq)")


def load_checkpoint(root: str, model: torch.nn.Module, optimizer, scheduler, *,
                    load_optim: bool = True, load_rng: bool = True,
                    finetune: bool = False) -> tuple[int, int]:
    """Load the latest checkpoint under `root` into model/optimizer/scheduler.

    Returns (iteration, consumed samples); (0, 0) when there is no checkpoint (training
    starts from scratch, as Megatron does) or with --finetune (weights only).
    """
    if not os.path.exists(root) or checkpoint_file(root) is None:
        return 0, 0
    state = read_checkpoint(root)
    path = state["_file"]
    _check_model_config(path, state.get("model_config"), getattr(model, "config", None))
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
