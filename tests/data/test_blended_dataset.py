"""Blending: Megatron's greedy index tracks the weights, is deterministic, and is cached."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megamoe.config import DataConfig
from megamoe.data import (
    BlendedDataset,
    DataError,
    IndexedDatasetBuilder,
    build_gpt_datasets,
    build_tokenizer,
)
from megamoe.data.blended_dataset import build_blending_indices, component_sizes


def _naive_greedy(weights, n):
    w = np.asarray(weights, float) / sum(weights)
    counts = np.zeros(len(w))
    out = []
    for i in range(n):
        err = w * max(i, 1) - counts
        k = int(np.argmax(err))  # first maximum, as Megatron's strict '>'
        out.append(k)
        counts[k] += 1
    return out


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.125, 0.125], [3, 1e-3]])
def test_greedy_index_tracks_weights(weights):
    n = 2000
    ds_idx, sample_idx = build_blending_indices(weights, n)
    assert ds_idx.tolist() == _naive_greedy(weights, n)
    w = np.asarray(weights) / sum(weights)
    for prefix in (10, 100, 1999, n):
        counts = np.bincount(ds_idx[:prefix], minlength=len(w))
        assert np.all(np.abs(counts - w * prefix) <= 1.0 + 1e-9), (prefix, counts)
    for k in range(len(w)):  # each component read in order 0, 1, 2, ...
        assert sample_idx[ds_idx == k].tolist() == list(range(int((ds_idx == k).sum())))
    again = build_blending_indices(weights, n)
    assert np.array_equal(again[0], ds_idx) and np.array_equal(again[1], sample_idx)


def test_component_sizes_have_margin():
    assert component_sizes([0.75, 0.25], 1000) == [754, 252]
    with pytest.raises(DataError):
        component_sizes([0, 0], 10)


class _Const:
    def __init__(self, tag, n):
        self.tag, self.n = tag, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert 0 <= i < self.n
        return (self.tag, i)


def test_blended_items_come_from_components():
    ds = BlendedDataset([_Const("a", 80), _Const("b", 30)], [3, 1], 100)
    items = [ds[i] for i in range(len(ds))]
    assert len(ds) == 100
    assert sum(t == "a" for t, _ in items) == 75
    assert [i for t, i in items if t == "b"] == list(range(25))
    with pytest.raises(DataError, match="component 1 has 10 samples"):
        BlendedDataset([_Const("a", 80), _Const("b", 10)], [3, 1], 100)


def _corpus(path, base, n_docs, eod):
    with IndexedDatasetBuilder(str(path) + ".bin", np.int32) as b:
        for d in range(n_docs):
            b.add_document([base + (d * 11 + t) % 900 for t in range(15)] + [eod])
        b.finalize(str(path) + ".idx")
    return str(path)


def test_weighted_data_path_blends_and_caches(tmp_path):
    eod = 5000
    tok = build_tokenizer("NullTokenizer", vocab_size=eod + 1)
    a = _corpus(tmp_path / "a", 1000, 50, eod)
    b = _corpus(tmp_path / "b", 3000, 50, eod)
    cfg = DataConfig(data_path=["0.8", a, "0.2", b], split="90,10,0")
    train, valid, test = build_gpt_datasets(cfg, tok, (200, 20, 0), seq_length=8, seed=1234)
    assert isinstance(train, BlendedDataset) and len(train) == 200 and test is None
    # Which corpus each sample came from: its first non-eod token's range.
    src = [next(t for t in train[i]["tokens"].tolist() if t != eod) // 1000 for i in range(200)]
    assert src.count(1) == 160 and src.count(3) == 40
    blend_files = sorted(f for f in os.listdir(tmp_path / "cache") if "Blended" in f)
    assert len(blend_files) == 4  # train + valid, two arrays each
    again = build_gpt_datasets(cfg, tok, (200, 20, 0), seq_length=8, seed=1234)[0]
    assert all(again[i]["tokens"].tolist() == train[i]["tokens"].tolist() for i in range(200))


def test_per_split_data_paths(tmp_path):
    eod = 5000
    tok = build_tokenizer("NullTokenizer", vocab_size=eod + 1)
    a = _corpus(tmp_path / "a", 1000, 20, eod)
    b = _corpus(tmp_path / "b", 3000, 20, eod)
    cfg = DataConfig(train_data_path=[a, b], valid_data_path=[b])
    train, valid, test = build_gpt_datasets(cfg, tok, (40, 10, 10), seq_length=8, seed=1234)
    assert test is None and len(train) == 40
    # valid uses all of b's documents (no split applied)
    assert sorted(set(valid.document_index.tolist())) == list(range(20))
    assert all(3000 <= t < 4000 or t == eod for i in range(len(valid))
               for t in valid[i]["tokens"].tolist())


def test_unweighted_data_path_blends_by_dataset_size(tmp_path):
    """Megatron's BlendedMegatronDatasetBuilder with weights None: each prefix's split is
    one epoch (num_samples None), the weights are their sample counts, the blend holds
    min(requested, sum of counts) samples, so nothing repeats (not equal weights)."""
    eod = 5000
    tok = build_tokenizer("NullTokenizer", vocab_size=eod + 1)
    a = _corpus(tmp_path / "a", 1000, 10, eod)  # 10 x 16 tokens: (160 - 1) // 8 = 19
    b = _corpus(tmp_path / "b", 3000, 30, eod)  # 30 x 16 tokens: (480 - 1) // 8 = 59
    for cfg in (DataConfig(data_path=[a, b], split="100,0,0"),
                DataConfig(train_data_path=[a, b])):
        train = build_gpt_datasets(cfg, tok, (60, 0, 0), seq_length=8, seed=1234)[0]
        assert [len(d) for d in train.datasets] == [19, 59] and len(train) == 60
        assert train.dataset_index.tolist() == _naive_greedy([19, 59], 60)
        src = [next(t for t in train[i]["tokens"].tolist() if t != eod) // 1000
               for i in range(60)]
        assert (src.count(1), src.count(3)) == (15, 45)  # 60 x 19/78 and 60 x 59/78
        with pytest.raises(DataError, match="the train split holds 78 samples of 8 tokens "
                                            r"\(19, 59\) but 79 are needed"):
            build_gpt_datasets(cfg, tok, (79, 0, 0), seq_length=8, seed=1234)
    whole = build_gpt_datasets(DataConfig(data_path=[a, b], split="100,0,0"), tok, (78, 0, 0),
                               seq_length=8, seed=1234)[0]
    used = {(int(d), int(s)) for d, s in zip(whole.dataset_index, whole.dataset_sample_index)}
    assert len(used) == 78  # every sample of both datasets exactly once
