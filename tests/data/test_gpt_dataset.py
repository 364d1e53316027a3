"""GPTDataset: samples are the shuffled document stream, cut into seq_length + 1 windows."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megamoe.config import DataConfig
from megamoe.data import (
    DataError,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    build_tokenizer,
)
from megamoe.data.builder import parse_split, split_document_ranges
from megamoe.data.gpt_dataset import build_sample_index, num_epochs_needed

EOD = 100_000  # NullTokenizer(vocab_size=EOD + 1) has eod == EOD


def _make(tmp_path, lengths, name="corpus", multi=False):
    """Documents of the given lengths; doc d holds tokens 100*d + t ... then EOD.

    With multi=True every document is stored as two sequences (plus an empty one)."""
    prefix = str(tmp_path / name)
    docs = []
    with IndexedDatasetBuilder(prefix + ".bin", np.int32) as b:
        for d, n in enumerate(lengths):
            toks = [1000 * (d + 1) + t for t in range(n - 1)] + [EOD]
            docs.append(toks)
            if multi:
                h = len(toks) // 2
                b.add_document(toks, [h, 0, len(toks) - h])
            else:
                b.add_document(toks)
        b.finalize(prefix + ".idx")
    return prefix, docs


def _stream(docs, ds):
    """The token stream GPTDataset should cut: documents in its document-index order."""
    indexed = ds.indexed
    seq_to_doc = np.searchsorted(indexed.document_indices, np.arange(len(indexed)), "right") - 1
    out = []
    for seq in ds.document_index:
        out.extend(indexed.get(int(seq)).tolist())
        assert int(seq_to_doc[seq]) < len(docs)
    return out


@pytest.mark.parametrize("multi", [False, True])
def test_samples_are_the_contiguous_stream(tmp_path, multi):
    lengths = [5, 9, 3, 12, 7, 4]
    prefix, docs = _make(tmp_path, lengths, multi=multi)
    seq = 6
    ds = GPTDataset(IndexedDataset(prefix), np.arange(len(docs)), 20, seq, seed=3, eod=EOD)
    # Document index: each epoch is a permutation of all documents' sequences.
    per_epoch = sum(1 for _ in IndexedDataset(prefix).sequence_lengths)
    epochs = len(ds.document_index) // per_epoch
    assert epochs == num_epochs_needed(sum(lengths), seq, 20)
    for e in range(epochs):
        chunk = ds.document_index[e * per_epoch:(e + 1) * per_epoch]
        assert sorted(chunk.tolist()) == list(range(per_epoch))
    if multi:  # a document's sequences stay together and in order
        di = ds.document_index.tolist()
        for i, s in enumerate(di):
            if s % 3 == 0:
                assert di[i + 1:i + 3] == [s + 1, s + 2]
    stream = _stream(docs, ds)
    assert len(ds) == (len(stream) - 1) // seq >= 20
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        want = stream[j * seq: j * seq + seq + 1]
        item = ds[i]
        assert item["tokens"].tolist() == want[:-1]
        assert item["labels"].tolist() == want[1:]
        assert item["tokens"].dtype == item["labels"].dtype == item["position_ids"].dtype
        assert item["loss_mask"].dtype.is_floating_point
        assert item["position_ids"].tolist() == list(range(seq))
        assert item["loss_mask"].tolist() == [1.0] * seq


def test_sample_index_skips_empty_sequences():
    lengths = np.array([3, 0, 0, 4, 0, 5], np.int32)
    si = build_sample_index(lengths, np.arange(6), 3)
    # stream positions 0,3,6,9 -> (seq 0, 0), (seq 3, 0), (seq 3, 3), (seq 5, 2)
    assert si.tolist() == [[0, 0], [3, 0], [3, 3], [5, 2]]


def test_eod_mask_and_reset_position_ids(tmp_path):
    prefix, docs = _make(tmp_path, [3, 4, 5, 6])
    ds = GPTDataset(IndexedDataset(prefix), np.arange(4), 4, 8, seed=1, eod=EOD,
                    eod_mask_loss=True, reset_position_ids=True)
    seen = 0
    for i in range(len(ds)):
        item = ds[i]
        toks = item["tokens"].tolist()
        mask = item["loss_mask"].tolist()
        assert mask == [0.0 if t == EOD else 1.0 for t in toks]
        pos, p = [], 0
        for t in toks:
            pos.append(p)
            p = 0 if t == EOD else p + 1
        assert item["position_ids"].tolist() == pos
        seen += toks.count(EOD)
    assert seen > 0


def test_split_is_by_documents():
    assert split_document_ranges(436, parse_split("98,2,0")) == [(0, 427), (427, 436),
                                                                   (436, 436)]
    assert split_document_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999),
                                                                     (999, 1000)]
    assert parse_split("1") == [1.0, 0.0, 0.0]
    with pytest.raises(DataError):
        parse_split("a,b")


def _config(prefix, seq_length=8, seed=1234, **kw):
    """(DataConfig, the sample shape and seed build_gpt_datasets takes beside it)."""
    return DataConfig(data_path=[prefix], **kw), dict(seq_length=seq_length, seed=seed)


def build_gpt_datasets(config_and_shape, tok, num_samples):
    from megamoe.data import build_gpt_datasets as build

    config, shape = config_and_shape
    return build(config, tok, num_samples, **shape)


def test_build_splits_documents_disjointly(tmp_path):
    prefix, docs = _make(tmp_path, [6 + (d % 5) for d in range(40)])
    tok = build_tokenizer("NullTokenizer", vocab_size=EOD + 1)
    train, valid, test = build_gpt_datasets(_config(prefix, split="70,20,10"), tok, (30, 8, 4))
    owner = {}
    for name, ds in (("train", train), ("valid", valid), ("test", test)):
        for s in set(ds.document_index.tolist()):
            assert owner.setdefault(s, name) == name
    assert sorted(owner) == list(range(40))
    assert {s for s, n in owner.items() if n == "valid"} == set(range(28, 36))
    assert build_gpt_datasets(_config(prefix, split="100,0,0"), tok, (30, 8, 4))[1:] == (
        None, None)
    assert build_gpt_datasets(_config(prefix), tok, (30, 0, 0))[1:] == (None, None)


def test_deterministic_and_cached(tmp_path):
    prefix, _ = _make(tmp_path, [5 + (d % 7) for d in range(30)])
    tok = build_tokenizer("NullTokenizer", vocab_size=EOD + 1)
    cfg = _config(prefix, split="90,10,0")
    a = build_gpt_datasets(cfg, tok, (25, 5, 0))[0]
    cache = tmp_path / "cache"
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith(".npy")]) == 6  # train + valid, 3 each
    mtimes = {f: os.stat(cache / f).st_mtime_ns for f in files}
    b = build_gpt_datasets(cfg, tok, (25, 5, 0))[0]
    assert {f: os.stat(cache / f).st_mtime_ns for f in files} == mtimes  # reused
    assert sorted(os.listdir(cache)) == files
    for f in files:  # rebuilt from scratch gives the same bytes
        if f.endswith(".npy"):
            os.remove(cache / f)
    c = build_gpt_datasets(cfg, tok, (25, 5, 0))[0]
    for ds in (b, c):
        assert len(ds) == len(a)
        for i in range(len(a)):
            assert ds[i]["tokens"].tolist() == a[i]["tokens"].tolist()
    # A different seed or seq_length is a different cache entry and a different order.
    d = build_gpt_datasets(_config(prefix, split="90,10,0", seed=99), tok, (25, 5, 0))[0]
    assert [d[i]["tokens"].tolist() for i in range(5)] != [a[i]["tokens"].tolist()
                                                          for i in range(5)]
    assert len(os.listdir(cache)) > len(files)


def test_explicit_cache_path_and_pickle(tmp_path):
    import pickle

    prefix, _ = _make(tmp_path, [8] * 10)
    tok = build_tokenizer("NullTokenizer", vocab_size=EOD + 1)
    cfg = _config(prefix, split="1", data_cache_path=str(tmp_path / "elsewhere"))
    ds = build_gpt_datasets(cfg, tok, (6, 0, 0))[0]
    assert len(os.listdir(tmp_path / "elsewhere")) == 4  # 3 indices + description
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[3]["tokens"].tolist() == ds[3]["tokens"].tolist()


def test_short_split_repeats_and_empty_split_is_an_error(tmp_path):
    prefix, docs = _make(tmp_path, [3, 3])
    tok = build_tokenizer("NullTokenizer", vocab_size=EOD + 1)
    ds = build_gpt_datasets(_config(prefix, split="1"), tok, (4, 0, 0))[0]
    assert len(ds) >= 4 and len(ds.document_index) == 2 * num_epochs_needed(6, 8, 4)
    stream = _stream(docs, ds)
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        assert ds[i]["tokens"].tolist() == stream[j * 8:j * 8 + 8]
    with IndexedDatasetBuilder(str(tmp_path / "empty.bin"), np.int32) as b:
        b.add_document([])
        b.add_document([])
        b.finalize(str(tmp_path / "empty.idx"))
    with pytest.raises(DataError, match="empty: the train split's 2 documents hold no tokens"):
        build_gpt_datasets(_config(str(tmp_path / "empty"), split="1"), tok, (4, 0, 0))


def test_token_ids_beyond_vocab_rejected(tmp_path):
    prefix, _ = _make(tmp_path, [10] * 4)
    tok = build_tokenizer("NullTokenizer", vocab_size=1000)  # corpus ids reach 4008
    with pytest.raises(DataError, match="corpus.bin: token id"):
        build_gpt_datasets(_config(prefix), tok, (4, 0, 0))


def test_regenerated_corpus_invalidates_the_cache(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=EOD + 1)
    prefix, _ = _make(tmp_path, [5, 9, 6, 8] * 3)
    a = build_gpt_datasets(_config(prefix, split="1"), tok, (8, 0, 0))[0]
    prefix, docs = _make(tmp_path, [9, 5, 8, 6] * 3)  # same sizes on disk, other lengths
    b = build_gpt_datasets(_config(prefix, split="1"), tok, (8, 0, 0))[0]
    assert not np.array_equal(np.asarray(a.sample_index), np.asarray(b.sample_index))
    stream = _stream(docs, b)
    j = int(b.shuffle_index[0])
    assert b[0]["tokens"].tolist() == stream[j * 8:j * 8 + 8]
