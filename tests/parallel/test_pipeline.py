"""Pipeline schedules and stage splits (pure; the multi-process parity is in
tests/training/test_pretrain_pipeline.py)."""

from __future__ import annotations

import pytest

from megamoe.config import pipeline_layer_ranges
from megamoe.training.schedules.pipeline import one_f_one_b_order


def test_even_uneven_and_virtual_layer_ranges():
    assert pipeline_layer_ranges(8, 4) == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]
    assert pipeline_layer_ranges(7, 3, first=1, last=2) == [[(0, 1)], [(1, 5)], [(5, 7)]]
    assert pipeline_layer_ranges(3, 2, first=1) == [[(0, 1)], [(1, 3)]]
    assert pipeline_layer_ranges(8, 2, layers_per_virtual_stage=2) == [
        [(0, 2), (4, 6)], [(2, 4), (6, 8)]]


@pytest.mark.parametrize("args, message", [
    ((6, 4), "--num-layers (6) cannot be split over --pipeline-model-parallel-size (4)"),
    ((8, 2, 3), "--num-layers (8) must be divisible by --pipeline-model-parallel-size (2) x "
                "--num-layers-per-virtual-pipeline-stage (3)"),
    ((4, 2, None, 4), "every stage needs at least one layer"),
    ((4, 2, 1, 1), "cannot be combined"),
])
def test_bad_splits_name_the_flags(args, message):
    with pytest.raises(ValueError) as e:
        pipeline_layer_ranges(*args[:3], *(args[3:4] if len(args) > 3 else ()))
    assert message in str(e.value)


def _simulate(m: int, pp: int, chunks: int) -> None:
    """Run every rank's order with non-blocking sends and blocking receives; fail on a
    deadlock (no rank can progress) or a task run before its input exists."""
    orders = {r: one_f_one_b_order(m, pp, r, chunks) for r in range(pp)}
    last = pp * chunks - 1
    done: set[tuple[str, int, int]] = set()  # (kind, virtual stage, micro-batch)
    pos = dict.fromkeys(range(pp), 0)
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            kind, c, mb = orders[r][pos[r]]
            v = c * pp + r
            if kind == "F":
                ready = v == 0 or ("F", v - 1, mb) in done
            else:
                ready = ("F", v, mb) in done and (v == last or ("B", v + 1, mb) in done)
            if ready:
                done.add((kind, v, mb))
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock: m={m} pp={pp} chunks={chunks} at {pos}"
    assert len(done) == 2 * m * pp * chunks


@pytest.mark.parametrize("m, pp, chunks", [(1, 2, 1), (4, 2, 1), (8, 4, 1), (3, 4, 1),
                                           (4, 4, 2), (8, 2, 3), (4, 2, 2)])
def test_schedules_cover_every_task_once_and_never_deadlock(m, pp, chunks):
    for r in range(pp):
        order = one_f_one_b_order(m, pp, r, chunks)
        assert sorted(order) == sorted((k, c, mb) for k in "FB" for c in range(chunks)
                                       for mb in range(m))
    _simulate(m, pp, chunks)


def test_1f1b_warmup_keeps_at_most_pp_minus_rank_in_flight():
    order = one_f_one_b_order(8, 4, 0)
    assert [k for k, _, _ in order[:4]] == ["F", "F", "F", "F"]
    assert order[4][0] == "B"
    last = one_f_one_b_order(8, 4, 3)
    assert [k for k, _, _ in last[:4]] == ["F", "B", "F", "B"]


def test_interleaved_needs_microbatches_multiple_of_pp():
    with pytest.raises(ValueError, match="divisible by --pipeline-model-parallel-size"):
        one_f_one_b_order(3, 2, 0, num_chunks=2)
