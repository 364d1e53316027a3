"""PretrainingSampler: layout-independent global batches and exact resume;
RandomPretrainingSampler (--dataloader-type cyclic): Megatron's per-epoch permutations,
exact resume, an iterator without end."""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.data import DataError, PretrainingSampler, RandomPretrainingSampler, make_iterator


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


# --- --dataloader-type cyclic -------------------------------------------------------------

def _megatron_random_sampler(total, consumed, mbs, rank, dp, data_sharding):
    """MegatronPretrainingRandomSampler.__iter__ (megatron/training/datasets/
    data_samplers.py), transcribed: one epoch's micro-batches from `consumed`."""
    chunk = mbs * dp
    active_total = total - total % chunk
    epoch, current = consumed // active_total, consumed % active_total
    g = torch.Generator()
    g.manual_seed(epoch)
    if data_sharding:
        bucket_size = (total // chunk) * mbs
        start = rank * bucket_size
        idx_range = [start + x for x in
                     torch.randperm(bucket_size, generator=g).tolist()[current // dp:]]
    else:
        full = (total // mbs) * mbs
        idx_range = torch.randperm(full, generator=g).tolist()[current:][rank::dp]
    return [idx_range[i:i + mbs] for i in range(0, len(idx_range) - mbs + 1, mbs)]


def _epochs(sampler, n):
    """n passes over the sampler (what the cyclic iterator does)."""
    return [list(sampler) for _ in range(n)]


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("total,mbs,dp", [(53, 2, 2), (40, 1, 4), (36, 3, 2)])
def test_random_sampler_is_megatrons(total, mbs, dp, sharding):
    chunk = mbs * dp
    for rank in range(dp):
        s = RandomPretrainingSampler(total, 0, mbs, rank, dp, data_sharding=sharding)
        for epoch, batches in enumerate(_epochs(s, 3)):
            assert batches == _megatron_random_sampler(total, epoch * (total - total % chunk),
                                                       mbs, rank, dp, sharding)


@pytest.mark.parametrize("sharding", [True, False])
def test_random_sampler_reshuffles_every_epoch(sharding):
    total, mbs, dp = 50, 2, 2
    per_rank = [_epochs(RandomPretrainingSampler(total, 0, mbs, r, dp, sharding), 3)
                for r in range(dp)]
    epochs = [[i for r in range(dp) for b in per_rank[r][e] for i in b] for e in range(3)]
    for e in epochs:
        assert len(e) == len(set(e)) == 48 and all(0 <= i < total for i in e)  # no repeats
        assert e != sorted(e)
    assert epochs[0] != epochs[1] != epochs[2]  # a new order each epoch
    if sharding:  # each rank stays in its bucket of the dataset
        assert {i for b in per_rank[1][0] for i in b} == set(range(24, 48))


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("stop", [3, 12, 13, 20])  # mid-epoch, at and past an epoch end
def test_random_sampler_resumes_exactly(sharding, stop):
    total, mbs, dp = 50, 2, 2  # 12 steps of one micro-batch per rank per epoch
    for rank in range(dp):
        full = [b for e in _epochs(RandomPretrainingSampler(total, 0, mbs, rank, dp, sharding), 3)
                for b in e]
        resumed = RandomPretrainingSampler(total, stop * mbs * dp, mbs, rank, dp, sharding)
        assert [b for e in _epochs(resumed, 2) for b in e][:12] == full[stop:stop + 12]


def test_cyclic_iterator_runs_past_the_dataset_and_resumes():
    ds = [{"x": torch.tensor([i])} for i in range(10)]
    it = make_iterator(ds, 0, 2, 0, 1, 0, dataloader_type="cyclic")
    got = [next(it)["x"].flatten().tolist() for _ in range(12)]  # 2.4 epochs of 5 batches
    assert sorted(i for b in got[:5] for i in b) == list(range(10))
    assert got[:5] != got[5:10]
    again = make_iterator(ds, 14, 2, 0, 1, 0, dataloader_type="cyclic")
    assert [next(again)["x"].flatten().tolist() for _ in range(5)] == got[7:12]
    single = make_iterator(ds, 0, 2, 0, 1, 0)
    assert len(list(single)) == 5  # single: in order, ends with the dataset
    with pytest.raises(DataError, match="--dataloader-type cyclic"):
        next(make_iterator(ds[:1], 0, 2, 0, 1, 0, dataloader_type="cyclic"))


@pytest.mark.parametrize("flags,kind,sharding", [("", "single", True),
                                                 ("--dataloader-type cyclic", "cyclic", True),
                                                 ("--dataloader-type cyclic --no-data-sharding",
                                                  "cyclic", False)])
def test_pretrain_reads_through_the_chosen_sampler(monkeypatch, flags, kind, sharding):
    import megamoe.data.loaders as loaders  # pretrain.py reads through run_iterator there
    from tests.training.test_pretrain import TINY_MOE

    seen = []
    orig = loaders.make_iterator
    monkeypatch.setattr(loaders, "make_iterator",
                        lambda *a, **kw: seen.append(kw) or orig(*a, **kw))
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 2 {flags}"), world_size=1)
    assert pretrain(args, print_fn=lambda _m: None).iteration == 2
    assert seen and all(kw["dataloader_type"] == kind and kw["data_sharding"] == sharding
                        for kw in seen)
