"""Count the host reads of whole training iterations of `pretrain` (a tests' helper).

`train_step` is wrapped to mark where each iteration starts; everything between the start
of iteration i and that of i + 1 (the step, the loop's bookkeeping, a logging iteration's
batched read and report) is iteration i's. The TensorBoard/W&B logger is a recording stub
(`RecordingLogger`), so a logging iteration also writes scalars and the expert-load
heatmap without either library."""

from __future__ import annotations

import shlex
from typing import Optional

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training import loop
from megamoe.training import pretrain as training_pretrain
from tests.moe.test_host_syncs import HostSyncCounter


class RecordingLogger:
    """MetricsLogger's interface; keeps what it was given."""

    def __init__(self, *_a, **_k) -> None:
        self.scalars: list[tuple[int, dict]] = []
        self.images: list[int] = []
        self.lines: list[dict] = []  # the console lines' values, unrounded

    def log_scalars(self, scalars: dict, step: int) -> None:
        self.scalars.append((step, dict(scalars)))

    def log_image(self, _name: str, _image, step: int) -> None:
        self.images.append(step)

    def close(self) -> None:
        pass


def iteration_reads(argv: str, world_size: int = 1, eager: bool = False,
                    logger: Optional[RecordingLogger] = None
                    ) -> tuple[dict[int, list[tuple[str, str]]], list[str]]:
    """({iteration: [(op, file:line), ...]} for every iteration but the last, whose span
    runs into the end of training; the printed lines). `eager`: every step reads its
    values at once (train_step's default), the reference for the logged numbers;
    `logger`: stands in for the MetricsLogger that --tensorboard-dir builds, and records
    the values of the console lines before they are rounded."""
    args = parse_args(shlex.split(argv), world_size=world_size)
    starts: list[int] = []
    lines: list[str] = []
    step, logger_class, line = (loop.train_step, training_pretrain.MetricsLogger,
                                loop.format_log_line)
    with HostSyncCounter() as counter:
        def marked(*a, **kw):
            starts.append(len(counter.events))
            if eager:
                kw["read"] = True
            return step(*a, **kw)

        def recorded_line(**kw):
            logger.lines.append({k: kw[k] for k in ("iteration", "losses", "grad_norm",
                                                    "num_zeros", "params_norm",
                                                    "skipped_iters", "nan_iters")})
            return line(**kw)

        loop.train_step = marked
        if logger is not None:
            training_pretrain.MetricsLogger = lambda *_a, **_k: logger
            loop.format_log_line = recorded_line
        try:
            pretrain(args, print_fn=lines.append)
        finally:
            loop.train_step, training_pretrain.MetricsLogger = step, logger_class
            loop.format_log_line = line
    reads = {i + 1: counter.events[starts[i]:starts[i + 1]] for i in range(len(starts) - 1)}
    return reads, lines


def rank_reads(rank: int, world_size: int, argv: str) -> dict:
    """One rank of a run_distributed test: its iterations' reads."""
    return iteration_reads(argv, world_size)[0]
