"""Index files built once per cache directory, whatever the number of processes.

Megatron builds its dataset indices on rank 0 while the other ranks wait at a barrier
(bounded by --distributed-timeout-minutes), then every rank loads them. Here the cache
directory itself coordinates: the first process to create `<first file>.lock` builds,
the others poll for the finished files, so it works the same with a shared cache (one
build per cluster), a node-local one (one per node) or no torch.distributed at all.
A waiter gives up after the timeout with one line naming the lock and its holder; a
lock left by a dead process on this host is taken over.

Every build, load and wait prints how long it took (the builder always; the others on
rank 0 only), so a slow start shows which index it spent its time on.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from typing import Callable, Iterator, Sequence

from megamoe.data.atomic import remove_quietly
from megamoe.data.errors import DataError

DEFAULT_TIMEOUT_S = 600.0  # Megatron's --distributed-timeout-minutes default, 10
POLL_S = 0.5


def log(msg: str, always: bool = False) -> None:
    if always or os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"megamoe.data: {msg}\n")
        sys.stderr.flush()


@contextlib.contextmanager
def timed(what: str, verb: str = "built", always: bool = True) -> Iterator[None]:
    start = time.perf_counter()
    yield
    log(f"{what} {verb} in {time.perf_counter() - start:.2f} s", always)


def _holder(lock: str) -> str:
    try:
        with open(lock, encoding="utf-8") as f:
            return f.read(200).strip() or "unknown"
    except OSError:
        return "unknown"


def _dead_local_holder(lock: str) -> bool:
    """The lock names a process on this host that no longer exists."""
    parts = _holder(lock).split()
    if len(parts) != 2 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _take_lock(lock: str) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
    return True


def build_once(paths: Sequence[str], build: Callable[[], None], what: str,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Make sure every file in `paths` exists: "cached" (already there), "built" (by
    this process, with `build()`, which must write them atomically) or "waited" (for
    another). OSError when the directory cannot be written (callers keep the index in
    memory); DataError after `timeout_s` of waiting."""
    if all(os.path.isfile(p) for p in paths):
        return "cached"
    lock = paths[0] + ".lock"
    os.makedirs(os.path.dirname(lock) or ".", exist_ok=True)
    start, holder = time.monotonic(), None  # holder: set once another process builds
    while True:
        if holder is not None and all(os.path.isfile(p) for p in paths):
            log(f"{what}: waited {time.monotonic() - start:.2f} s for {holder}")
            return "waited"
        if _take_lock(lock):
            try:
                if all(os.path.isfile(p) for p in paths):
                    return "cached"
                with timed(what):
                    build()
                return "built"
            finally:
                remove_quietly(lock)
        holder = _holder(lock)
        if _dead_local_holder(lock):
            remove_quietly(lock)
            continue
        if time.monotonic() - start > timeout_s:
            raise DataError(f"{lock}: waited {timeout_s:.0f} s for {holder} to build "
                            f"{what}; if that process is gone, delete the lock file")
        time.sleep(POLL_S)
