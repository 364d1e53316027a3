"""Run a test body on N gloo ranks (spawned processes) under a hard timeout.

    results = run_distributed(fn, world_size=4, timeout=120, *args)

`fn(rank, world_size, *args)` must be a module-level function (it is pickled into the
children by reference). Each child gets torchrun-style environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), an initialised gloo process group and one compute
thread, runs fn, and sends back its return value. A failure on any rank raises with that
rank's traceback; a hang (wrong split sizes in a collective hang instead of raising on gloo)
kills every rank and raises TimeoutError naming the test body.

The children fork from a forkserver that imported torch and megamoe once per test process
(a spawned child re-imports them: 3-10 s per rank on two busy cores, 0.3 s forked), and
take the parent's environment as it is at the call, as spawned children would (a
forkserver's own environment is the one it started with). MEGAMOE_TEST_SPAWN=1 spawns.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the forkserver; every child forks with them loaded (copy-on-write).
PRELOAD = ["torch", "torch.distributed", "numpy", "megamoe.cli.main", "tests.distributed"]
_CONTEXT: list = []


def _context():
    """The multiprocessing context the ranks start from (made once per test process)."""
    if os.environ.get("MEGAMOE_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    if not _CONTEXT:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _child(fn: Callable, rank: int, world_size: int, port: int, timeout: float,
           results: Any, args: tuple, environ: dict) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environ)  # the caller's, as a spawned child would have it
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        out = fn(rank, world_size, *args)
        # By value: the queue's own pickler passes tensors as shared-memory handles that
        # the parent must fetch from this process, which may have exited by then (seen
        # under load as FileNotFoundError in resource_sharer).
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report every failure to the parent, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, timeout: float = 120.0,
                    *args: Any) -> list[Any]:
    """Returns [fn's result on rank 0, ..., rank world_size - 1].

    The rendezvous port is picked free but can be taken by another process before rank 0
    binds it (tests running side by side): that one failure is retried on a new port.
    """
    for _ in range(2):
        try:
            return _run_once(fn, world_size, timeout, args)
        except RuntimeError as e:
            if "address already in use" not in str(e).lower():
                raise
    return _run_once(fn, world_size, timeout, args)


def _run_once(fn: Callable, world_size: int, timeout: float, args: tuple) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_child,
                         args=(fn, r, world_size, port, timeout, results, args, environ),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"{name}: ranks {missing} did not finish within "
                                   f"{timeout:.0f} s (hung collective?)") from None
            if not ok:
                raise RuntimeError(f"{name} failed on rank {rank}:\n{value}")
            out[rank] = pickle.loads(value)  # noqa: S301 (our own child's result)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
