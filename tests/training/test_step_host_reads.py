"""Host reads of whole training iterations (issue 27): a step reads the dropless
dispatch's token counts once per MoE layer and micro-batch (as Megatron) plus ONE value
outside logging iterations, the optimizer's verdict (gradient norm, NaN/Inf check and
loss-scale overflow in one copy: it decides whether to step); a logging iteration adds ONE
batched read of every statistic and metric it shows (training/host_read.py).

Counted on CPU by kind of call (tests/moe/test_host_syncs.py HostSyncCounter: what would
block a GPU) over `pretrain`'s iterations, the loop's bookkeeping and logging included.
Before this budget the same 4-layer model read 66 values a step (docs/gpu-path.md)."""

from __future__ import annotations

import re

import pytest

from tests.distributed import run_distributed
from tests.training.step_reads import RecordingLogger, iteration_reads, rank_reads
from tests.training.test_pretrain import TINY_MOE

# 4 MoE layers, 4 micro-batches a step (global 8 / micro 2); a console line every 3rd
# iteration and none of its own for the first ones: iterations 1, 2 do not log, 3 does.
FOUR_LAYERS = (TINY_MOE.replace("--num-layers 2", "--num-layers 4")
               .replace("--log-interval 1", "--log-interval 3 --log-first-iterations 0")
               + " --train-iters 4 --moe-per-layer-logging --log-num-zeros-in-grad"
               " --log-params-norm")
DISPATCH = ("nonzero", "megamoe/moe/permute.py")  # the dropless permutation's row count
VERDICT = ("tolist", "megamoe/training/nonfinite.py")  # grad norm + NaN/Inf + overflow
LOGGED = ("tolist", "megamoe/training/host_read.py")  # every logged value, one copy


def _kinds(events: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for op, where in events:
        key = (op, where.split(":")[0])
        out[key] = out.get(key, 0) + 1
    return out


def _assert_budget(reads: dict, dispatch_reads: int) -> None:
    for iteration in (1, 2):  # not logging: the dispatch's, then the verdict
        assert _kinds(reads[iteration]) == {DISPATCH: dispatch_reads, VERDICT: 1}, \
            (iteration, reads[iteration])
    # logging (console line, logger scalars, heatmap): plus the one batched read
    assert _kinds(reads[3]) == {DISPATCH: dispatch_reads, VERDICT: 1, LOGGED: 1}, reads[3]


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_whole_step_reads_one_rank(dispatcher, tmp_path):
    """Dropless, EP1: 4 layers x 4 micro-batches = 16 dispatch reads a step."""
    logger = RecordingLogger()
    reads, _ = iteration_reads(f"{FOUR_LAYERS} --moe-token-dispatcher-type {dispatcher} "
                               f"--tensorboard-dir {tmp_path} --tensorboard-log-interval 3",
                               logger=logger)
    _assert_budget(reads, dispatch_reads=16)
    assert [step for step, _ in logger.scalars][0] == 3  # it logged at the line
    assert logger.images and logger.images[0] == 3  # and drew the heatmap at the line


@pytest.mark.slow  # 15-35 s on the shared 2-core machine: over the default set's share
def test_whole_step_reads_pipeline_parallel():
    """PP2 on 2 gloo ranks, 2 MoE layers per stage: 8 dispatch reads a step on each; the
    loss stays on the last stage and reaches the other by the schedule's broadcast, the
    MoE logging values are summed over the stages on the device. (The first step also
    exchanges which stage logs which layer once, an object all-gather: not counted.)"""
    out = run_distributed(rank_reads, 2, 300,
                          f"{FOUR_LAYERS} --pipeline-model-parallel-size 2")
    for rank, reads in enumerate(out):
        for iteration in (2, 3):
            expect = {DISPATCH: 8, VERDICT: 1, **({LOGGED: 1} if iteration == 3 else {})}
            assert _kinds(reads[iteration]) == expect, (rank, iteration, reads[iteration])


_TIMES = re.compile(r"\[\d{4}-[^]]*\]|(elapsed time per iteration \(ms\)|throughput[^:]*"
                    r"|TFLOP/s/GPU|ETA|took|in) *:? *[\d.]+[^|]*")


def _values_of(line: str) -> str:
    """A console line without its clock, throughput and memory fields (the console's
    extras come after Megatron's last field, the nan-iteration count)."""
    return _TIMES.sub("", line.split("number of nan iterations")[0]) + line.split(
        "number of nan iterations")[-1][:8]


def test_logged_numbers_are_those_of_per_step_reads(tmp_path):
    """The console lines and the logger's scalars of the batched reads are exactly those of
    reading every step at once (train_step's default: what the loop did before). Same
    process, same kernels: equal to the bit."""
    argv = f"{FOUR_LAYERS} --train-iters 7 --tensorboard-dir {tmp_path}"
    got, want = RecordingLogger(), RecordingLogger()
    _, lazy_lines = iteration_reads(argv, logger=got)
    _, eager_lines = iteration_reads(argv, logger=want, eager=True)
    untimed = ("iteration_time_ms", "throughput", "memory", "mfu")

    def values(logger):
        return [(s, {k: v for k, v in row.items() if not k.startswith(untimed)})
                for s, row in logger.scalars]

    assert values(got) == values(want)
    assert got.lines == want.lines and len(got.lines) == 2  # interval means, unrounded
    lazy = [_values_of(x) for x in lazy_lines if "iteration " in x]
    assert lazy == [_values_of(x) for x in eager_lines if "iteration " in x]
    assert any("load_balancing_loss" in x for x in lazy)


def test_a_nan_step_between_lines_is_counted_at_the_next_line(monkeypatch, tmp_path):
    """The nan-iteration count (a skipped step whose loss is NaN/Inf) needs the loss, which
    is read at the next logging iteration, not at the step: a NaN loss in iteration 2 (the
    NaN/Inf check off, so the step is skipped) shows at the iteration-3 line and in the
    final state."""
    from tests.training.inject import install

    install("nan-loss:2:0", monkeypatch.setattr)
    logger = RecordingLogger()
    reads, _ = iteration_reads(f"{FOUR_LAYERS} --no-check-for-nan-in-loss-and-grad "
                               f"--tensorboard-log-interval 3 --tensorboard-dir {tmp_path}",
                               logger=logger)
    assert [(x["iteration"], x["skipped_iters"], x["nan_iters"]) for x in logger.lines] \
        == [(3, 1, 1)]
    assert _kinds(reads[2]) == {DISPATCH: 16, VERDICT: 1}  # the skipped step reads no more
