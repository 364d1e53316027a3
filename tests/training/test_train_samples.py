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

import numpy as np
import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.data import IndexedDatasetBuilder
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
    from the console lines (--log-interval 1). A --data-path in `extra` replaces the mock
    data."""
    out: list[str] = []
    base = BASE.replace("--mock-data ", "") if "--data-path" in extra else BASE
    args = parse_args(shlex.split(f"{base} {extra}"), world_size=world_size)
    state = pretrain(args, print_fn=out.append)
    _run.lines = out  # the console, for the tests that read more than the step lines
    steps = [m.groups() for line in out for m in [LINE.search(line)] if m]
    return state, [(int(i), int(n), int(c), float(lr), int(b)) for i, n, c, lr, b in steps]


def megatron_rampup(train_samples: int, gbs: int, start: int, increment: int,
                    ramp_samples: int) -> list[int]:
    """The global batch size of every step for --train-samples with --rampup-batch-size
    start increment ramp_samples and --global-batch-size gbs: the sizes of Megatron's old
    RampupBatchsizeNumMicroBatchesCalculator, stepped as Megatron now counts the steps of
    a --step-batch-size-schedule (update_train_iters: until the consumed samples reach
    --train-samples), which is how megamoe runs the deprecated flag."""
    per_increment = ramp_samples / ((gbs - start) // increment)

    def batch(consumed: int) -> int:  # RampupBatchsizeNumMicroBatchesCalculator.update
        if consumed > ramp_samples:
            return gbs
        return start + int(consumed / per_increment) * increment

    sizes, consumed = [], 0
    while consumed < train_samples:
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


@pytest.mark.parametrize("ramp,sizes", [
    ("2 2 24", [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8]),  # an increment every 24 / 3 = 8
    ("2 2 20", [2, 2, 2, 2, 4, 4, 6, 8, 8, 8, 8, 8]),  # every 20 / 3 = 6.67 samples
])
def test_rampup_batch_sizes_samples_and_lr_follow_megatron(ramp, sizes):
    """--rampup-batch-size to --global-batch-size 8 with --train-samples 60: every step's
    batch size, consumed samples, the number of steps and the rate as Megatron's."""
    want = megatron_rampup(60, 8, *map(int, ramp.split()))
    assert want == sizes  # the formula, spelled out
    state, steps = _run(f"--train-samples 60 --rampup-batch-size {ramp} "
                        "--lr-warmup-samples 10 --lr-decay-style linear")
    assert [s[4] for s in steps] == want
    consumed = _cumulative(want)
    assert [s[2] for s in steps] == consumed
    assert [(s[0], s[1]) for s in steps] == [(i + 1, len(want)) for i in range(len(want))]
    assert state.consumed_train_samples == consumed[-1] == sum(sizes)
    notes = [ln for ln in _run.lines if "--rampup-batch-size" in ln]
    assert len(notes) == 1 and "Megatron-LM ignores this flag" in notes[0], notes
    lrs = [megatron_lr(c, 10, 60, "linear", max_lr=1e-3, min_lr=0.0) for c in consumed]
    assert [h["lr"] for h in state.history] == pytest.approx(lrs, rel=1e-12, abs=0)


def _corpus(prefix: str, seed: int, eod: int = 96) -> str:  # --vocab-size 97: EOD 96
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix + ".bin", np.int32) as b:
        for _ in range(100):
            b.add_document(list(rng.integers(0, eod, int(rng.integers(5, 40)))) + [eod])
        b.finalize(prefix + ".idx")
    return prefix


def test_rampup_last_step_may_pass_train_samples_as_megatron(tmp_path):
    """Megatron counts schedule steps while consumed < --train-samples, so the last step
    can take more: 11 samples asked, 6 steps, 14 consumed. The training set
    holds the samples the steps take, also where a blend of datasets has exactly the size
    asked for."""
    want = megatron_rampup(11, 8, 2, 2, 30)
    assert want == [2, 2, 2, 2, 2, 4]
    a, b = _corpus(str(tmp_path / "a"), 0), _corpus(str(tmp_path / "b"), 1)
    for data in ("", f"--data-path 0.5 {a} 0.5 {b} --split 100,0,0"):
        state, steps = _run(f"--train-samples 11 --rampup-batch-size 2 2 30 {data}")
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


RAMP_4_LAYERS = "--train-samples 56 --rampup-batch-size 4 4 8 --num-layers 4"


def _layout_worker(rank: int, world_size: int, layout: str) -> tuple[list[float], list[int]]:
    state, steps = _run(f"{RAMP_4_LAYERS} {layout}", world_size)
    return [h["lm loss"] for h in state.history], [s[4] for s in steps]


@pytest.mark.parametrize("layout", [
    pytest.param("", marks=pytest.mark.slow),  # data parallel: micro-batch 2 x dp 2 per chunk
    pytest.param("--pipeline-model-parallel-size 2",  # 1F1B over 2, then 4 micro-batches
                 marks=pytest.mark.slow),
    pytest.param("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
                 marks=pytest.mark.slow),
], ids=["dp2", "pp2", "pp2_interleaved"])
def test_rampup_on_two_ranks_matches_single_process(layout):
    """The same global batches, batch sizes and losses on 2 ranks as on one."""
    state, steps = _run(RAMP_4_LAYERS)
    assert [s[4] for s in steps] == megatron_rampup(56, 8, 4, 4, 8) == [4, 4] + [8] * 6
    ranks = run_distributed(_layout_worker, 2, 180, layout)
    logged = [sizes for _, sizes in ranks if sizes]  # the logging rank's console lines
    assert logged == [[s[4] for s in steps]]
    for losses, _ in ranks:  # every rank holds the step's loss (pipelining: a copy)
        assert len(losses) == len(state.history)
        for a, b in zip([h["lm loss"] for h in state.history], losses):
            assert abs(a - b) <= 1e-5 * abs(a)


@pytest.mark.parametrize("flags,world,message", [
    ("--train-iters 4 --train-samples 40", 1,
     "--train-iters and --train-samples are mutually exclusive"),
    ("--train-iters 5 --train-samples 40", 1,  # even where they agree (40 / 8 = 5)
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
    ("--train-samples 40 --lr-decay-style WSD --lr-wsd-decay-iters 2", 1,
     "--lr-wsd-decay-iters is for iteration-based training: with --train-samples use "
     "--lr-wsd-decay-samples"),
    ("--train-iters 4 --lr-decay-style WSD --lr-wsd-decay-samples 8", 1,
     "--lr-wsd-decay-samples needs --train-samples"),
    ("--train-samples 40 --lr-warmup-fraction 0.1 --lr-warmup-samples 4", 1,
     "--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive"),
    ("--train-iters 4 --lr-warmup-fraction 0.1 --lr-warmup-iters 1", 1,
     "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive"),
    ("--train-samples 40 --lr-decay-samples 0", 1, "--lr-decay-samples must be positive"),
    ("--train-samples 40 --lr-warmup-samples=-1", 1, "--lr-warmup-samples must be >= 0"),
    ("--train-samples 40 --lr-decay-style WSD --lr-wsd-decay-samples=-1", 1,
     "--lr-wsd-decay-samples must be >= 0"),
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


def test_train_config_derives_the_iterations_for_library_users():
    from megamoe.config import TrainConfig
    from megamoe.config.fields import ConfigError

    assert TrainConfig().train_iters == 10  # neither length given: the library default
    t = TrainConfig(global_batch_size=8, micro_batch_size=2, train_samples=60,
                    rampup_batch_size=[2, 2, 20])
    sizes = megatron_rampup(60, 8, 2, 2, 20)
    assert t.train_iters == len(sizes) == 12
    assert [t.global_batch_size_at(sum(sizes[:i])) for i in range(12)] == sizes
    assert t.samples_for_iters(12) == sum(sizes) and t.samples_for_iters(3) == 6
    t.validate()  # validating again keeps the derived length
    with pytest.raises(ConfigError, match="mutually exclusive"):
        TrainConfig(global_batch_size=8, train_samples=60, train_iters=3)


def megatron_step_sizes(train_samples: int, schedule: list[tuple[int, int]]) -> list[int]:
    """Every step's global batch size under Megatron's StepBatchsizeNumMicroBatches-
    Calculator (thresholds already in samples) for --train-samples (update_train_iters)."""
    def batch(consumed: int) -> int:
        size = schedule[0][1]
        for threshold, bs in schedule:
            if consumed >= threshold:
                size = bs
            else:
                break
        return size

    sizes, consumed = [], 0
    while consumed < train_samples:
        sizes.append(batch(consumed))
        consumed += sizes[-1]
    return sizes


def test_step_batch_size_schedule_follows_megatron():
    """--step-batch-size-schedule thresholds count tokens (pretrain_gpt.py passes
    --seq-length 16): 0, 64 and 160 tokens are samples 0, 4 and 10."""
    want = megatron_step_sizes(30, [(0, 2), (4, 4), (10, 8)])
    assert want == [2, 2, 4, 4, 8, 8, 8]
    base = BASE.replace("--global-batch-size 8 ", "")
    args = parse_args(shlex.split(f'{base} --train-samples 30 --step-batch-size-schedule '
                                  f'"0:2 64:4 160:8" --log-interval 1'), world_size=1)
    out: list[str] = []
    state = pretrain(args, print_fn=out.append)
    steps = [m.groups() for line in out for m in [LINE.search(line)] if m]
    assert [int(s[4]) for s in steps] == want
    assert [int(s[2]) for s in steps] == _cumulative(want) and state.iteration == 7
