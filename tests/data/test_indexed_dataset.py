"""Megatron .bin/.idx: round trips, byte-level interchange, corruption -> DataError."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megamoe.data import DataError, IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from megamoe.data.indexed_dataset import MAGIC


def _build(prefix, docs, dtype=np.int32):
    """docs: list of documents, each a list of sequences (lists of ints)."""
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype) as b:
        for doc in docs:
            for seq in doc:
                b.add_item(seq)
            b.end_document()
        b.finalize(f"{prefix}.idx")
    return IndexedDataset(str(prefix))


DOCS = [[[1, 2, 3]], [[4, 5], [6], []], [], [[7, 8, 9, 10]], [[]]]


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint16, np.int32, np.int64,
                                   np.float32])
def test_round_trip(tmp_path, dtype):
    ds = _build(tmp_path / "d", DOCS, dtype)
    seqs = [s for d in DOCS for s in d]
    assert len(ds) == len(seqs) and ds.dtype == np.dtype(dtype)
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
        assert ds[i].dtype == np.dtype(dtype)
    assert ds.sequence_lengths.tolist() == [len(s) for s in seqs]
    assert ds.document_indices.tolist() == [0, 1, 4, 4, 5, 6]
    assert ds.num_documents == len(DOCS)
    assert ds.get(1, offset=1).tolist() == [5]
    assert ds.get(4, offset=1, length=2).tolist() == [8, 9]
    assert [a.tolist() for a in ds[0:2]] == [[1, 2, 3], [4, 5]]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)


def test_add_document_with_lengths_matches_add_item(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "a.bin"), np.uint16) as b:
        b.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
        b.add_document([9])
        b.finalize(str(tmp_path / "a.idx"))
    _build(tmp_path / "b", [[[1, 2], [3, 4, 5]], [[9]]], np.uint16)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a{ext}").read_bytes() == (tmp_path / f"b{ext}").read_bytes()


def test_header_bytes_match_megatron(tmp_path):
    """Hand-packed Megatron-LM index: proves files interchange with Megatron both ways."""
    _build(tmp_path / "d", [[[5, 6, 7]], [[8], [9, 10]]], np.uint16)
    lengths = np.array([3, 1, 2], np.int32)
    pointers = np.array([0, 6, 8], np.int64)  # byte offsets of uint16 tokens
    docs = np.array([0, 1, 3], np.int64)
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                + struct.pack("<Q", 3) + struct.pack("<Q", 3)
                + lengths.tobytes() + pointers.tobytes() + docs.tobytes())
    assert (tmp_path / "d.idx").read_bytes() == expected
    assert (tmp_path / "d.bin").read_bytes() == np.arange(5, 11, dtype="<u2").tobytes()
    # And a hand-written file loads.
    (tmp_path / "m.idx").write_bytes(expected)
    (tmp_path / "m.bin").write_bytes(np.arange(5, 11, dtype="<u2").tobytes())
    ds = IndexedDataset(str(tmp_path / "m"))
    assert [ds[i].tolist() for i in range(3)] == [[5, 6, 7], [8], [9, 10]]


def test_optimal_dtype():
    assert optimal_dtype(2048) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32


def test_pickle_reopens_by_path(tmp_path):
    import pickle

    ds = _build(tmp_path / "d", DOCS)
    blob = pickle.dumps(ds)
    assert len(blob) < 200  # the path, not the mapped arrays
    assert pickle.loads(blob)[4].tolist() == [7, 8, 9, 10]


def test_unfinished_build_publishes_nothing(tmp_path):
    (tmp_path / "d.bin").write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.int32) as b:
            b.add_item([1, 2])
            raise RuntimeError("killed")
    assert (tmp_path / "d.bin").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["d.bin"]


def _corrupt(path, fn):
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(fn(data)))


_PTR1 = 34 + 6 * 4 + 8  # header, 6 int32 lengths, first int64 pointer
CORRUPTIONS = {
    "bad magic": ("idx", lambda d: b"XXIDIDX\x00\x00" + d[9:]),
    "wrong version": ("idx", lambda d: d[:9] + struct.pack("<Q", 2) + d[17:]),
    "unknown dtype": ("idx", lambda d: d[:17] + b"\x09" + d[18:]),
    "truncated index": ("idx", lambda d: d[:-5]),
    "short header": ("idx", lambda d: d[:12]),
    "sequence count": ("idx", lambda d: d[:18] + struct.pack("<Q", 99) + d[26:]),
    "bad pointer": ("idx", lambda d: d[:_PTR1] + struct.pack("<q", 3) + d[_PTR1 + 8:]),
    "bad doc indices": ("idx", lambda d: d[:-8] + struct.pack("<q", 2)),
    "truncated bin": ("bin", lambda d: d[:-4]),
    "extra bin": ("bin", lambda d: d + b"\x00" * 4),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corruption_is_a_data_error_naming_the_file(tmp_path, case):
    _build(tmp_path / "d", DOCS)
    ext, fn = CORRUPTIONS[case]
    _corrupt(tmp_path / f"d.{ext}", fn)
    with pytest.raises(DataError) as e:
        IndexedDataset(str(tmp_path / "d"))
    msg = str(e.value)
    assert "\n" not in msg
    assert str(tmp_path / "d.idx") in msg or str(tmp_path / "d.bin") in msg


def test_missing_file(tmp_path):
    _build(tmp_path / "d", DOCS)
    os.remove(tmp_path / "d.bin")
    with pytest.raises(DataError, match=r"d\.bin: file not found"):
        IndexedDataset(str(tmp_path / "d"))


def test_magic_constant():
    assert MAGIC == b"MMIDIDX\x00\x00"
