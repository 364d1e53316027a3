"""PretrainingSampler: layout-independent global batches and exact resume."""

from __future__ import annotations

import pytest
import torch

from megamoe.data import PretrainingSampler


def _global_batches(total, consumed, mbs, dp):
    per_rank = [list(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    assert len({len(p) for p in per_rank}) == 1
    return [sum((per_rank[r][i] for r in range(dp)), []) for i in range(len(per_rank[0]))]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_same_global_batches_for_any_dp(dp):
    gbs, total = 8, 53
    ref = [list(range(s, s + gbs)) for s in range(0, total - gbs + 1, gbs)]
    batches = _global_batches(total, 0, gbs // dp, dp)
    # Group micro-batch rounds into global batches of gbs samples.
    flat = [i for b in batches for i in b]
    regrouped = [flat[s:s + gbs] for s in range(0, len(flat) - gbs + 1, gbs)]
    assert regrouped == ref


@pytest.mark.parametrize("dp,mbs", [(1, 4), (2, 2), (4, 1), (2, 1)])
def test_rank_slices(dp, mbs):
    s = PretrainingSampler(30, 0, mbs, dp - 1, dp)
    out = list(s)
    assert len(s) == len(out) == 30 // (mbs * dp)
    assert out[0] == list(range((dp - 1) * mbs, dp * mbs))
    assert all(len(b) == mbs for b in out)


def test_resume_continues_the_exact_order():
    full = list(PretrainingSampler(40, 0, 2, 1, 2))
    resumed = list(PretrainingSampler(40, 12, 2, 1, 2))
    assert resumed == full[3:]
    assert list(PretrainingSampler(40, 40, 2, 0, 2)) == []
    assert len(PretrainingSampler(40, 100, 2, 0, 2)) == 0


def test_trailing_partial_chunk_dropped():
    assert list(PretrainingSampler(7, 0, 2, 0, 2)) == [[0, 1]]
    assert list(PretrainingSampler(7, 0, 2, 1, 2)) == [[2, 3]]


def test_works_as_dataloader_batch_sampler():
    ds = torch.arange(100)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=PretrainingSampler(100, 10, 3, 1, 2))
    first = next(iter(loader))
    assert first.tolist() == [13, 14, 15]


@pytest.mark.parametrize("kw", [dict(micro_batch_size=0), dict(data_parallel_rank=2),
                                dict(consumed_samples=-1)])
def test_rejects_bad_arguments(kw):
    args = dict(total_samples=10, consumed_samples=0, micro_batch_size=1,
                data_parallel_rank=0, data_parallel_size=2)
    args.update(kw)
    with pytest.raises(ValueError):
        PretrainingSampler(**args)
