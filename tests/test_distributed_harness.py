"""The multi-process harness itself: real collectives, failures and hangs are reported."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _uneven_all_to_all(rank: int, world_size: int) -> list[float]:
    # rank r sends (d + 1) copies of value 10*r + d to rank d: uneven splits both ways.
    send_splits = [d + 1 for d in range(world_size)]
    send = torch.cat([torch.full((d + 1,), float(10 * rank + d)) for d in range(world_size)])
    recv_splits = [rank + 1] * world_size
    recv = torch.empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return recv.tolist() + total.tolist()


def test_uneven_all_to_all_and_all_reduce_on_four_ranks():
    results = run_distributed(_uneven_all_to_all, 4, 60)
    for rank, got in enumerate(results):
        expected = [float(10 * src + rank) for src in range(4) for _ in range(rank + 1)]
        assert got == expected + [6.0]


def _fails_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")


def test_failure_names_rank_and_traceback():
    with pytest.raises(RuntimeError, match="failed on rank 1") as exc:
        run_distributed(_fails_on_rank_one, 2, 60)
    assert "boom on purpose" in str(exc.value)


def _hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(30)


@pytest.mark.slow
def test_hang_ends_with_timeout_error():
    start = time.time()
    with pytest.raises((TimeoutError, RuntimeError)):
        run_distributed(_hangs, 2, 5)
    assert time.time() - start < 25
