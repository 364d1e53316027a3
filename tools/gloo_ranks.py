"""Run a benchmark body on N gloo ranks of this machine and return rank 0's result.

Shared by the multi-rank benchmarks (bench_dispatch.py, bench_adaptive.py): spawned
processes, one thread each, a file rendezvous (no TCP port another process could take
between choosing and binding it), and one line plus a non-zero exit as soon as a rank dies
or the time runs out (a dead rank would otherwise leave the others waiting in a collective).
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue as queue_module
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Body = Callable[[int, int, argparse.Namespace], Any]  # (rank, world, args) -> result


def _rank_main(rank: int, world: int, init_file: str, body: Body, args: argparse.Namespace,
               timeout: float, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))
    try:
        result = body(rank, world, args)
        if rank == 0:
            queue.put(result)
            queue.close()
            queue.join_thread()  # the result is in the pipe before this process ends
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # No gloo teardown: destroying the group (or the interpreter's exit destroying it)
    # while a peer's last transfer is in flight aborts with std::terminate in gloo's
    # transport (seen under load on 2 cores even after the barrier); the OS closes the
    # sockets of an exited process cleanly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _collect(queue, procs: list, timeout: float, name: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queue_module.Empty:
            failed = [proc.exitcode for proc in procs if proc.exitcode]
            if failed:
                for proc in procs:
                    proc.kill()
                sys.exit(f"{name}: a rank failed (exit codes {failed})")
    for proc in procs:
        proc.kill()
    sys.exit(f"{name}: no result within --timeout {timeout:g} s")


def run_gloo_ranks(body: Body, world_size: int, args: argparse.Namespace, timeout: float,
                   name: str) -> Any:
    """body(rank, world_size, args) on `world_size` spawned gloo ranks; rank 0's return."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="megamoe-bench-"), "rendezvous")
    procs = [ctx.Process(target=_rank_main,
                         args=(r, world_size, init_file, body, args, timeout, queue))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        result = _collect(queue, procs, timeout, name)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    failed = [proc.exitcode for proc in procs if proc.exitcode]
    if failed:
        sys.exit(f"{name}: a rank failed (exit codes {failed})")
    return result
