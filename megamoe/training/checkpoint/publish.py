"""Megatron's checkpoint directory layout and the crash-safe publish protocol that both
formats share.

    SAVE/iter_0000100/model_optim_rng.pt         --ckpt-format torch (single file)
    SAVE/iter_0000100/{.metadata,*.distcp,common.pt}   --ckpt-format torch_dist (default;
                                                 sharded, any layout: dist.py)
    SAVE/latest_checkpointed_iteration.txt      ("100")

Publish protocol (a process killed at any instant leaves the last complete checkpoint
loadable and the pointer valid):
  1. write + fsync `iter_N.tmp.PID/...`
  2. rename it to `iter_N` (re-saving N: `iter_N` -> `iter_N.old.PID` first; readers fall
     back to that copy while `iter_N` is missing)
  3. replace the pointer file by rename
  4. retention (--ckpt-keep-last; Megatron's --save-retain-interval: the checkpoint the
     pointer named before is deleted unless its iteration is a multiple of the interval):
     rename old `iter_M` to `iter_M.del.PID`, then delete; never the one the pointer names,
     and only checkpoints of the pointer chain
Pointer chain: each published `iter_N` holds LINK, the iteration the pointer named before
it was published. Retention walks the chain from the pointer and prunes only what it
reaches: `iter_*` directories another program (or an earlier run whose pointer was lost)
wrote are never deleted.
Leftovers of a killed save (`*.tmp.*`, `*.old.*`, `*.del.*`) are cleaned by the next save.
Loading detects the format from the directory's contents, whatever --ckpt-format says.

A save that fails (a full disk, a permission: any OSError) removes its `iter_N.tmp.PID`
and raises CheckpointError naming the --save directory and the error, on every rank
(`agree`): the previous checkpoint and the pointer are untouched, since the pointer is
replaced only after the new directory is complete. (A failure while replacing the pointer
itself leaves the new, complete `iter_N` unnamed; loading still finds the previous one.)
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import time
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megamoe.training.checkpoint.safe_load import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"
LINK = "megamoe_previous_iteration.txt"  # in iter_N: the pointer's iteration before N
COMMON = "common.pt"  # torch_dist: rank 0's non-tensor state, written after the shards
# Test hook for the crash tests: "PHASE:ITERATION:MARKER" makes the writer create MARKER and
# sleep when the save of ITERATION ("*": any) reaches PHASE, so a test can SIGKILL it (or
# signal it) at a known point of the publish protocol; PAUSE_SECONDS_ENV: for how long
# (default an hour).
PAUSE_ENV = "MEGAMOE_CKPT_TEST_PAUSE"
PAUSE_SECONDS_ENV = "MEGAMOE_CKPT_TEST_PAUSE_SECONDS"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


class Retention(NamedTuple):
    """What a save deletes once published: all but the newest `keep_last` (megamoe's
    --ckpt-keep-last), and the previous checkpoint unless its iteration is a multiple of
    `retain_interval` (Megatron's --save-retain-interval)."""
    keep_last: Optional[int] = None
    retain_interval: Optional[int] = None


KeepLast = Union[int, Retention, None]  # what the save functions' `keep_last` takes


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def pause_point(phase: str, iteration: int) -> None:
    spec = os.environ.get(PAUSE_ENV, "").split(":", 2)
    if len(spec) == 3 and spec[0] == phase and spec[1] in ("*", str(iteration)):
        open(spec[2], "w").close()
        time.sleep(float(os.environ.get(PAUSE_SECONDS_ENV, "3600")))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")


class _RecordingWriter:
    """A file's write() for torch.save that keeps the OSError it raised: torch's zip
    writer swallows it and reports a short write ("unexpected pos ...") instead."""

    def __init__(self, f) -> None:
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_torch_file(obj: Any, path: str) -> None:
    """torch.save `obj` to `path`, flushed and fsynced; a failed write raises its OSError
    (ENOSPC, EACCES, ...), not torch's "unexpected pos"."""
    with open(path, "wb") as f:
        writer = _RecordingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())


def dcp_failure(e: BaseException) -> tuple[Optional[int], BaseException]:
    """(the lowest failing rank, its exception) of DCP's CheckpointException, which
    carries each failing rank's (exception, traceback); (None, e) for any other error."""
    if not (isinstance(e, CheckpointException) and e.failures):
        return None, e
    rank = min(e.failures)
    inner = e.failures[rank]
    return rank, inner[0] if isinstance(inner, tuple) else getattr(inner, "exception", inner)


def failure_reason(e: BaseException) -> tuple[Optional[int], str]:
    """(the failing rank if DCP names one, what went wrong in one line): the OSError in
    the exception's chain where there is one ("[Errno 28] No space left on device")."""
    rank, e = dcp_failure(e)
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return rank, str(cur).strip().splitlines()[0]
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    text = str(e).strip().splitlines()
    return rank, f"{e.__class__.__name__}: {text[0][:200]}" if text else e.__class__.__name__


def failure_message(root: str, iteration: int, e: BaseException, rank: int,
                    world: int) -> str:
    """One line: which save of which --save directory failed, where and why."""
    failing, reason = failure_reason(e)
    failing = rank if failing is None else failing
    where = f" on rank {failing}" if world > 1 else ""
    return f"saving checkpoint iteration {iteration} to {root} failed{where}: {reason}"


def agree(error: Optional[str], world: int, group=None) -> Optional[str]:
    """Collective (also a barrier): every rank learns the lowest failing rank's message,
    or None when no rank failed."""
    if world == 1:
        return error
    errors: list[Optional[str]] = [None] * world
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e), None)


def discard_tmp(tmp: Optional[str]) -> None:
    """Remove a failed save's temporary directory (nothing once it was published)."""
    if tmp is not None and os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)


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


def pointer_chain(root: str) -> list[int]:
    """The published iterations reached from the pointer through each checkpoint's LINK,
    ascending: the checkpoints megamoe's saves into `root` wrote, one after another. The
    walk stops at a missing directory, a missing or unreadable link, or a cycle (a run
    resumed from an older --ckpt-step re-saves iterations)."""
    it = _tracker_or_none(root)
    chain: list[int] = []
    while it is not None and it not in chain and _is_checkpoint_dir(iteration_dir(root, it)):
        chain.append(it)
        it = _read_int(os.path.join(iteration_dir(root, it), LINK))
    return sorted(chain)


def _read_int(path: str) -> Optional[int]:
    """A non-negative integer from a small text file this module wrote; None if absent or
    anything else (a link that cannot be trusted ends the chain: nothing is pruned)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(64)
        text = raw.decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if len(raw) < 64 and text.isdigit() else None


def _tracker_or_none(root: str) -> Optional[int]:
    try:
        return read_tracker(root)
    except CheckpointError:
        return None


def prune_checkpoints(root: str, keep_last: int, *, _saving: int = -1) -> list[int]:
    """Delete all but the newest `keep_last` checkpoints of the pointer chain, never the
    one the pointer names, never one outside the chain (`_delete`: crash-safe). Returns
    the deleted iterations."""
    chain = pointer_chain(root)
    keep = set(chain[-keep_last:])
    latest = read_tracker(root)
    if latest is not None:
        keep.add(latest)
    deleted = []
    for it in chain:
        if it in keep:
            continue
        _delete(root, it, _saving)
        deleted.append(it)
    return deleted


def _unretained(root: str, previous: Optional[int], iteration: int,
                interval: Optional[int]) -> bool:
    """Megatron's --save-retain-interval: once `iteration` is published, the checkpoint the
    pointer named before it goes, unless its iteration is a multiple of `interval` (or a
    symbolic link, which Megatron skips too)."""
    if not interval or previous is None or previous == iteration or previous % interval == 0:
        return False
    path = iteration_dir(root, previous)
    return not os.path.islink(path) and _is_checkpoint_dir(path)


def _delete(root: str, iteration: int, saving: int) -> None:
    """Rename `iter_N` out of the checkpoint namespace first, so a crash mid-delete never
    leaves a half-deleted directory that looks like a checkpoint."""
    doomed = f"{iteration_dir(root, iteration)}.del.{os.getpid()}"
    os.replace(iteration_dir(root, iteration), doomed)
    pause_point("prune", saving)
    shutil.rmtree(doomed, ignore_errors=True)


def prepare_tmp(root: str, iteration: int) -> str:
    """Step 0 of a save (one writer): clean what killed saves left, make the tmp dir."""
    os.makedirs(root, exist_ok=True)
    _clean_leftovers(root)
    tmp = f"{iteration_dir(root, iteration)}.tmp.{os.getpid()}"
    os.makedirs(tmp)
    return tmp


def publish_tmp(root: str, iteration: int, tmp: str, keep_last: KeepLast = None) -> str:
    """Steps 2-4: publish the complete `tmp` as iteration `iteration`, then the pointer,
    then retention (`keep_last`: a count or a Retention). Returns the published directory."""
    retention = keep_last if isinstance(keep_last, Retention) else Retention(keep_last)
    final = iteration_dir(root, iteration)
    previous = _tracker_or_none(root)
    link = previous
    dropped = _unretained(root, previous, iteration, retention.retain_interval)
    if dropped:  # the chain skips the checkpoint this save deletes
        link = _read_int(os.path.join(iteration_dir(root, previous), LINK))
    if link is not None:  # the pointer chain's link (retention prunes only the chain)
        with open(os.path.join(tmp, LINK), "w", encoding="ascii") as f:
            f.write(f"{link}\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
    if os.path.exists(final):  # re-saving an iteration: swap, never leave it unreadable
        old = f"{final}.old.{os.getpid()}"
        os.replace(final, old)
        pause_point("mid_swap", iteration)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    pause_point("after_publish", iteration)
    _atomic_write_text(os.path.join(root, TRACKER), f"{iteration}\n")
    pause_point("after_tracker", iteration)
    if dropped:
        _delete(root, previous, iteration)
    if retention.keep_last:
        prune_checkpoints(root, retention.keep_last, _saving=iteration)
    return final


def read_tracker(root: str) -> Optional[int]:
    """The latest published iteration, or None when `root` holds no checkpoint yet."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    value = _read_int(path)  # (the content is never quoted: the file may be a symlink)
    if value is None:
        raise CheckpointError(f"{path}: expected an iteration number")
    return value


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
        if glob.glob(os.path.join(iteration_dir(path, iteration), "mp_rank_*")):
            raise CheckpointError(f"{iteration_dir(path, iteration)}: a Megatron-LM "
                                  "--ckpt-format torch checkpoint (mp_rank_*); convert it "
                                  "first: tools/checkpoint/convert.py megatron-to-megamoe")
        raise CheckpointError(f"{iteration_dir(path, iteration)}: missing or incomplete "
                              f"(named by {os.path.join(path, TRACKER)})")
    return found


def is_dist_checkpoint(found: str) -> bool:
    """`found` (from checkpoint_file) names a torch_dist directory."""
    return os.path.isdir(found)
