"""Count the host reads of whole training iterations of `pretrain` (tests' helper).

`train_step` is wrapped to mark where each iteration starts; everything between the start
of iteration i and that of i + 1 (the step, the loop's bookkeeping, a logging iteration's
report) is iteration i's."""

from __future__ import annotations

import shlex

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training import loop
from tests.moe.test_host_syncs import HostSyncCounter


def iteration_reads(argv: str, world_size: int = 1) -> dict[int, list[tuple[str, str]]]:
    """{iteration: [(op, file:line), ...]} for every iteration but the last (whose span
    runs into the end of training)."""
    args = parse_args(shlex.split(argv), world_size=world_size)
    starts: list[int] = []
    step = loop.train_step
    with HostSyncCounter() as counter:
        def marked(*a, **kw):
            starts.append(len(counter.events))
            return step(*a, **kw)

        loop.train_step = marked
        try:
            pretrain(args, print_fn=lambda _m: None)
        finally:
            loop.train_step = step
    return {i + 1: counter.events[starts[i]:starts[i + 1]] for i in range(len(starts) - 1)}


def rank_reads(rank: int, world_size: int, argv: str) -> dict:
    return iteration_reads(argv, world_size)
