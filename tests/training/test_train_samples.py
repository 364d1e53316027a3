"""Sample-based training as in Megatron-LM: --train-samples, the --lr-*-samples schedule and
--rampup-batch-size.

The expected values are computed here from Megatron's own definitions, independently of
megamoe: RampupBatchsizeNumMicroBatchesCalculator.update and update_train_iters
(megatron/core/num_microbatches_calculator.py, megatron/training/training.py, before
Megatron replaced the ramp-up with --step-batch-size-schedule) and
OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py, through
tests/training/test_lr_schedule.megatron_lr). The batch size of each step is read from the
console line ("global batch size"), as a user reads it.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.checkpoint import read_checkpoint, read_tracker
from megamoe.training.loop import TrainState
from tests.distributed import run_distributed
from tests.flags import parse_error
from tests.training.test_lr_schedule import megatron_lr
from tests.training.test_pretrain import TINY_MOE

# TINY_MOE without its iteration-based warm-up (refused with --train-samples); gbs 8, mbs 2
BASE = TINY_MOE.replace("--lr-warmup-iters 1 ", "")
assert BASE != TINY_MOE
LINE = re.compile(r"iteration +(\d+)/ *(\d+) \| consumed samples: +(\d+) .*"
                  r"learning rate: (\S+) \| global batch size: +(\d+) \|")


def _run(extra: str, world_size: int = 1) -> tuple[TrainState, list[tuple]]:
    """The final state and, per step, (iteration, of, consumed, lr, global batch size)
    from the console lines (--log-interval 1)."""
    out: list[str] = []
    args = parse_args(shlex.split(f"{BASE} {extra}"), world_size=world_size)
    state = pretrain(args, print_fn=out.append)
    steps = [m.groups() for line in out for m in [LINE.search(line)] if m]
    return state, [(int(i), int(n), int(c), float(lr), int(b)) for i, n, c, lr, b in steps]


def megatron_rampup(train_samples: int, gbs: int, start: int, increment: int,
                    ramp_samples: int) -> list[int]:
    """The global batch size of every step Megatron takes for --train-samples with
    --rampup-batch-size start increment ramp_samples and --global-batch-size gbs."""
    per_increment = ramp_samples / ((gbs - start) // increment)

    def batch(consumed: int) -> int:  # RampupBatchsizeNumMicroBatchesCalculator.update
        if consumed > ramp_samples:
            return gbs
        return start + int(consumed / per_increment) * increment

    iterations = consumed = 0  # update_train_iters
    while consumed <= ramp_samples and consumed <= train_samples:
        consumed += batch(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    sizes, consumed = [], 0
    for _ in range(iterations):
        sizes.append(batch(consumed))
        consumed += sizes[-1]
    return sizes


def _cumulative(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i + 1]) for i in range(len(sizes))]


def test_train_samples_stops_at_the_sample_count_with_megatrons_lr():
    """--train-samples 44 at global batch 8: 44 // 8 = 5 iterations (the partial batch is
    dropped, as Megatron's update_train_iters); the rate after each step is Megatron's at
    the samples consumed, warm-up and decay in samples."""
    state, steps = _run("--train-samples 44 --lr-warmup-samples 12 --lr-decay-samples 36 "
                        "--min-lr 1e-4")
    assert state.iteration == 5 and state.consumed_train_samples == 40
    assert [s[:3] for s in steps] == [(i, 5, 8 * i) for i in range(1, 6)]
    assert all(s[4] == 8 for s in steps)
    want = [megatron_lr(8 * i, 12, 36, "cosine", max_lr=1e-3, min_lr=1e-4)
            for i in range(1, 6)]
    assert [h["lr"] for h in state.history] == pytest.approx(want, rel=1e-12, abs=0)
    assert [s[3] for s in steps] == pytest.approx(want, rel=1e-6)  # printed with 7 digits


def test_rampup_batch_sizes_samples_and_lr_follow_megatron():
    """--rampup-batch-size 2 2 24 to --global-batch-size 8: 3 increments, one every 8
    samples; every step's batch size, consumed samples and rate as Megatron's."""
    want = megatron_rampup(60, 8, 2, 2, 24)
    assert want == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8]  # the formula, spelled out
    state, steps = _run("--train-samples 60 --rampup-batch-size 2 2 24 "
                        "--lr-warmup-samples 10 --lr-decay-style linear")
    assert [s[4] for s in steps] == want
    consumed = _cumulative(want)
    assert [s[2] for s in steps] == consumed
    assert [(s[0], s[1]) for s in steps] == [(i + 1, len(want)) for i in range(len(want))]
    assert state.consumed_train_samples == consumed[-1] == 60
    lrs = [megatron_lr(c, 10, 60, "linear", max_lr=1e-3, min_lr=0.0) for c in consumed]
    assert [h["lr"] for h in state.history] == pytest.approx(lrs, rel=1e-12, abs=0)


def test_rampup_last_step_may_pass_train_samples_as_megatron():
    """Megatron counts ramp-up steps while consumed <= --train-samples, so its last
    ramp-up step can take more: 10 samples asked, 6 steps, 14 consumed."""
    want = megatron_rampup(10, 8, 2, 2, 30)
    assert want == [2, 2, 2, 2, 2, 4]
    state, steps = _run("--train-samples 10 --rampup-batch-size 2 2 30")
    assert [s[4] for s in steps] == want and state.consumed_train_samples == 14


def test_rampup_saves_a_checkpoint_before_each_batch_size_change(tmp_path):
    """As Megatron's train loop: with --save, a checkpoint when the number of micro-batches
    changes (before the first step with the new size), and the last one."""
    d = str(tmp_path / "ckpt")
    _run(f"--train-samples 40 --rampup-batch-size 2 2 12 --save {d}")
    sizes = megatron_rampup(40, 8, 2, 2, 12)
    assert sizes[:6] == [2, 2, 4, 6, 8, 8]  # one increment every 12 / 3 = 4 samples
    changes = [i for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]]
    assert changes == [2, 3, 4]
    saved = sorted(int(n[5:]) for n in os.listdir(d) if n.startswith("iter_"))
    assert saved == [*changes, len(sizes)]
    assert read_tracker(d) == len(sizes)
    ckpt = read_checkpoint(d)
    assert ckpt["consumed_train_samples"] == sum(sizes)


def _dp_worker(rank: int, world_size: int) -> tuple[list[float], list[int]]:
    state, steps = _run("--train-samples 56 --rampup-batch-size 4 4 8", world_size)
    return [h["lm loss"] for h in state.history], [s[4] for s in steps]


def test_rampup_data_parallel_matches_single_process():
    """The same global batches (micro-batch 2 x dp 2 per chunk) and losses on 2 ranks."""
    state, steps = _run("--train-samples 56 --rampup-batch-size 4 4 8")
    assert [s[4] for s in steps] == megatron_rampup(56, 8, 4, 4, 8) == [4, 4] + [8] * 6
    ranks = run_distributed(_dp_worker, 2, timeout=180)
    logged = [sizes for _, sizes in ranks if sizes]  # the logging rank's console lines
    assert logged == [[s[4] for s in steps]]
    for losses, _ in ranks:
        assert len(losses) == len(state.history)
        for a, b in zip([h["lm loss"] for h in state.history], losses):
            assert abs(a - b) <= 1e-5 * abs(a)


@pytest.mark.parametrize("flags,world,message", [
    ("--train-iters 4 --train-samples 40", 1,
     "--train-iters and --train-samples are mutually exclusive"),
    ("", 1, "one of --train-iters or --train-samples is required"),
    ("--train-samples 0", 1, "--train-samples must be positive, got 0"),
    ("--train-samples 40 --lr-decay-iters 3", 1,
     "--lr-decay-iters is for iteration-based training: with --train-samples use "
     "--lr-decay-samples"),
    ("--train-samples 40 --lr-warmup-iters 1", 1,
     "--lr-warmup-iters is for iteration-based training: with --train-samples use "
     "--lr-warmup-samples"),
    ("--train-iters 4 --lr-decay-samples 10", 1,
     "--lr-decay-samples needs --train-samples (iteration-based training uses "
     "--lr-decay-iters)"),
    ("--train-iters 4 --lr-warmup-samples 10", 1,
     "--lr-warmup-samples needs --train-samples"),
    ("--train-samples 40 --lr-warmup-fraction 0.1 --lr-warmup-samples 4", 1,
     "--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive"),
    ("--train-iters 4 --lr-warmup-fraction 0.1 --lr-warmup-iters 1", 1,
     "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive"),
    ("--train-samples 40 --lr-decay-samples 0", 1, "--lr-decay-samples must be positive"),
    ("--train-iters 4 --rampup-batch-size 2 2 16", 1,
     "--rampup-batch-size needs --train-samples"),
    ("--train-samples 40 --rampup-batch-size 8 2 16", 1,
     "--rampup-batch-size: start batch size (8) must be smaller than --global-batch-size (8)"),
    ("--train-samples 40 --rampup-batch-size 4 3 16", 1,
     "--rampup-batch-size: --global-batch-size (8) minus the start batch size (4) must be "
     "divisible by the batch size increment (3)"),
    ("--train-samples 40 --rampup-batch-size 2 2 0", 1,
     "--rampup-batch-size: ramp-up samples must be positive, got 0"),
    ("--train-samples 40 --rampup-batch-size 0 2 16", 1,
     "--rampup-batch-size: start batch size must be positive, got 0"),
    ("--train-samples 40 --rampup-batch-size 3 5 16", 1,
     "--rampup-batch-size: global batch size 3 of the ramp-up must be divisible by "
     "--micro-batch-size (2) x data-parallel size (1)"),
    ("--train-samples 40 --rampup-batch-size 2 2 16", 2,
     "--rampup-batch-size: global batch size 2 of the ramp-up must be divisible by "
     "--micro-batch-size (2) x data-parallel size (2)"),
    ("--train-samples 40 --rampup-batch-size 4 2 16", 2,
     "global batch size 6 of the ramp-up must be divisible"),
    ("--train-samples 40 --rampup-batch-size 2 x 16", 1, "invalid int value: 'x'"),
])
def test_refused_in_one_line(capsys, flags, world, message):
    err = parse_error(capsys, f"{BASE} {flags}", world)
    assert message in err, err
