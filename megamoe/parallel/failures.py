"""Turning a failed collective into one line that says which group and which operation.

A hung or broken collective surfaces as a backend error deep inside torch.distributed
("Timed out waiting 600000ms for recv operation", "Connection closed by peer", a store
"wait timeout") that names neither the process group nor the code that called it. On a
cluster, the person reading the log needs exactly those two facts. Instead of wrapping every
call site (and paying for it on every collective), the failure is explained after the fact
from its traceback: the innermost torch.distributed frame gives the operation and its
`group` argument, the innermost megamoe frame gives the caller, and the Mesh names the group.
"""

from __future__ import annotations

import os
import traceback
from types import TracebackType
from typing import Optional

import torch.distributed as dist

_MARKERS = ("gloo", "nccl", "c10d", "timed out", "timeout", "connection closed",
            "connection reset", "broken pipe")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIST = os.path.join("torch", "distributed", "")


class DistributedFailure(RuntimeError):
    """A collective, p2p transfer or process-group creation that timed out or lost a peer;
    the message is one line naming the rank, the operation, the group and the caller."""


def _frames(tb: Optional[TracebackType]) -> list:
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def _is_distributed(exc: BaseException, frames: list) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError) or isinstance(exc, DistributedFailure):
        return False
    text = str(exc).lower()
    in_torch_dist = any(_TORCH_DIST in f.f_code.co_filename for f in frames)
    return any(m in text for m in _MARKERS) and (in_torch_dist or "gloo" in text
                                                   or "nccl" in text)


def _on(op: str, group, mesh) -> str:
    return op if mesh is None else f"{op} on the {mesh.describe(group)}"


def _where(frames: list, mesh) -> str:
    """What failed: the innermost public torch.distributed call (with its `group`
    argument, named by the mesh), the rendezvous, or a group's creation."""
    for f in reversed(frames):
        name = f.f_code.co_name
        if _TORCH_DIST not in f.f_code.co_filename:
            continue
        if "rendezvous" in name:
            return (f"the rendezvous (store at {os.environ.get('MASTER_ADDR')}:"
                    f"{os.environ.get('MASTER_PORT')})")
        if name == "new_group":
            return (f"creating the {f.f_locals.get('group_desc') or 'process'} group "
                    f"(ranks {f.f_locals.get('ranks')})")
        if not name.startswith("_") and name != "wrapper":
            return _on(name, f.f_locals.get("group", f.f_locals.get("pg")), mesh)
    # an async work's wait(): the caller's frame may still hold the group
    group = next((f.f_locals["group"] for f in reversed(frames) if "group" in f.f_locals),
                 None)
    return _on("wait on an asynchronous collective or p2p transfer", group, mesh)


def _caller(frames: list) -> Optional[str]:
    """file:line (function) of the innermost megamoe frame."""
    for f in reversed(frames):
        path = f.f_code.co_filename
        if path.startswith(_PACKAGE + os.sep):
            rel = os.path.relpath(path, os.path.dirname(_PACKAGE))
            line = f.f_lineno
            return f"{rel}:{line} ({f.f_code.co_name})"
    return None


def _kind(text: str) -> str:
    low = text.lower()
    if "connection closed" in low or "connection reset" in low or "broken pipe" in low:
        return "lost a peer (another rank died or exited: see its log)"
    if "timed out" in low or "timeout" in low:
        return "timed out"
    return "failed"


def explain(exc: BaseException, mesh=None, timeout_minutes: Optional[float] = None,
            rank: Optional[int] = None) -> Optional[DistributedFailure]:
    """The one-line DistributedFailure for `exc`, or None when `exc` is not a failure of
    torch.distributed (then it is a bug and keeps its traceback)."""
    frames = _frames(exc.__traceback__)
    if not _is_distributed(exc, frames):
        return None
    rank = mesh.rank if mesh is not None and rank is None else rank
    kind = _kind(" ".join(str(exc).split()))
    parts = [f"rank {rank}: " if rank is not None else "", _where(frames, mesh), " ", kind]
    if timeout_minutes is not None and kind == "timed out":
        parts.append(f" (--distributed-timeout-minutes {timeout_minutes:g})")
    caller = _caller(frames)
    if caller:
        parts.append(f", called from {caller}")
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    parts.append(f"; {type(exc).__name__}: {' '.join(last.split(': ', 1)[-1].split())[:300]}")
    return DistributedFailure("".join(parts))
