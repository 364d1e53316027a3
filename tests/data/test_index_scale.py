"""Scalable index builders equal the reference loops they replace, element for element.

The blending index (compiled helper) is compared with the pure-Python greedy loop, the
chunked GPT indices with the whole-array NumPy versions they replaced (kept below as the
reference), on random and adversarial inputs and with tiny chunks so every chunk
boundary case is crossed.
"""

from __future__ import annotations

import numpy as np
import pytest

from megamoe.data import blend_native
from megamoe.data.blending_index import (
    _python_chunk,
    build_blending_indices,
    check_blending_indices,
    reference_blending_indices,
    write_blending_indices,
)
from megamoe.data.errors import DataError
from megamoe.data.gpt_indices import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    check_gpt_indices,
    epoch_stats,
    expand_documents,
)

ADVERSARIAL = [[1.0], [1, 1], [1, 1, 1], [0.1, 0.2, 0.3, 0.4], [1, 2, 3, 4, 5, 6, 7],
               [1e-12, 1, 1], [0.5, 0.25, 0.125, 0.125], [3, 1e-3], [1, 0, 1], [1] * 17,
               [2 / 3, 1 / 3], [0.7, 0.2, 0.1]]


def test_helper_builds():
    assert blend_native.load() is not None  # else the fast path is silently the slow one


@pytest.mark.parametrize("weights", ADVERSARIAL)
def test_blending_equals_reference_on_ties(weights):
    n = 3000
    got = build_blending_indices(weights, n)
    want = reference_blending_indices(weights, n)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_blending_equals_reference_on_random_weights():
    rng = np.random.default_rng(7)
    for trial in range(40):
        k = int(rng.integers(1, 40))
        n = int(rng.integers(0, 2500))
        w = (rng.random(k) if trial % 2 else rng.integers(1, 5, k) / 7.0).tolist()
        got = build_blending_indices(w, n)
        want = reference_blending_indices(w, n)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (w, n)


def test_blending_step_equal_at_large_positions():
    """Far into a 10^9-sample run (t large, errors near rounding): from the same counts,
    helper and reference make the same picks."""
    rng = np.random.default_rng(3)
    fn = blend_native.load()
    for k in (2, 3, 10, 100):
        w = (rng.integers(1, 4, k) / 3.0 if k < 10 else rng.random(k))
        w = (w / w.sum()).tolist()
        start = int(rng.integers(10**8, 10**9))
        counts = np.floor(np.asarray(w) * start).astype(np.int64)
        counts[0] += start - int(counts.sum())
        got = (np.empty(500, np.int16), np.empty(500, np.int64))
        blend_native.blend_chunk(fn, np.asarray(w), start, *got, counts.copy())
        want = (np.empty(500, np.int16), np.empty(500, np.int64))
        c = counts.tolist()
        _python_chunk(w, start, *want, c)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_streamed_blending_equals_in_memory(tmp_path):
    w = [0.3, 0.5, 0.2, 1e-3]
    paths = (str(tmp_path / "d.npy"), str(tmp_path / "s.npy"))
    counts = write_blending_indices(w, 10_001, paths, chunk=333)
    d, s = (np.load(p, mmap_mode="r") for p in paths)
    want = build_blending_indices(w, 10_001)
    assert np.array_equal(d, want[0]) and np.array_equal(s, want[1])
    assert counts.tolist() == np.bincount(want[0], minlength=4).tolist()
    check_blending_indices(d, s, 10_001, counts.tolist(), paths[0], chunk=1000)
    with pytest.raises(DataError, match="component 1 has"):
        check_blending_indices(d, s, 10_001, [10**6, 7, 10**6, 10**6], paths[0])
    with pytest.raises(DataError, match="expected int64"):
        check_blending_indices(d, d, 10_001, counts.tolist(), paths[0])


# The whole-array versions the chunked builders replaced: the reference.
def _ref_document_index(document_ids, document_indices, num_epochs, rng):
    per_epoch = [rng.permutation(document_ids) for _ in range(num_epochs)]
    docs = np.concatenate(per_epoch) if per_epoch else np.zeros(0, dtype=np.int64)
    seq_ids = expand_documents(document_indices, docs)
    dtype = np.int32 if seq_ids.size == 0 or seq_ids.max() < 2**31 else np.int64
    return seq_ids.astype(dtype)


def _ref_sample_index(sequence_lengths, document_index, seq_length):
    lengths = sequence_lengths[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    num_samples = (total - 1) // seq_length if total > 0 else 0
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[pos] - lengths[pos])
    dtype = np.int32 if len(document_index) < 2**31 else np.int64
    return np.stack([pos, offset], axis=1).astype(dtype)


def _corpus(rng, n_docs, ragged):
    """Random lengths (some empty); with `ragged`, 0..3 sequences per document."""
    per_doc = rng.integers(0, 4, n_docs) if ragged else np.ones(n_docs, np.int64)
    document_indices = np.concatenate([[0], np.cumsum(per_doc)]).astype(np.int64)
    lengths = rng.integers(0, 40, int(document_indices[-1])).astype(np.int32)
    lengths[rng.random(len(lengths)) < 0.2] = 0
    return lengths, document_indices


@pytest.mark.parametrize("ragged", [False, True])
def test_gpt_indices_equal_reference(ragged):
    rng = np.random.default_rng(11 + ragged)
    for trial in range(12):
        n_docs = int(rng.integers(1, 300))
        lengths, document_indices = _corpus(rng, n_docs, ragged)
        begin = int(rng.integers(0, n_docs))
        ids = np.arange(begin, int(rng.integers(begin + 1, n_docs + 1)))
        if trial % 4 == 1:  # not a range: the gather path
            ids = np.sort(rng.choice(n_docs, size=int(rng.integers(1, n_docs + 1)),
                                     replace=False))
        if ragged and trial % 3 == 0:  # one sequence each, but not sequence id == doc id
            ids = np.flatnonzero(np.diff(document_indices) == 1)
            if not ids.size:
                continue
        chunk = int(rng.integers(1, 50))
        epochs, seq = int(rng.integers(1, 4)), int(rng.integers(1, 64))
        seed = int(rng.integers(0, 1000))
        got = build_document_index(ids, document_indices, epochs, np.random.RandomState(seed),
                                   chunk=chunk)
        want = _ref_document_index(ids, document_indices, epochs, np.random.RandomState(seed))
        assert got.dtype == want.dtype and np.array_equal(got, want)
        stats = epoch_stats(ids, document_indices, lengths, chunk)
        seq_ids = expand_documents(document_indices, ids)
        assert stats[:2] == (len(seq_ids), int(lengths[seq_ids].sum()))
        if stats[1] == 0:
            continue
        si = build_sample_index(lengths, got, seq, chunk=chunk,
                                total_tokens=epochs * stats.tokens if trial % 2 else None)
        ref = _ref_sample_index(lengths, want, seq)
        assert si.dtype == ref.dtype and np.array_equal(si, ref)
        check_gpt_indices(got, si, np.arange(len(si) - 1), len(lengths), "x", chunk=chunk)
    for n in (0, 1, 2, 1000):
        shuffled = build_shuffle_index(n, np.random.RandomState(n))
        want = np.random.RandomState(n).permutation(n).astype(np.int32)
        assert shuffled.dtype == np.int32 and np.array_equal(shuffled, want)


def test_cached_gpt_indices_are_range_checked():
    doc = np.array([0, 2, 1], np.int32)
    si = np.array([[0, 0], [1, 3], [2, 1]], np.int32)
    check_gpt_indices(doc, si, np.array([1, 0], np.int32), 3, "f.npy")
    for args, msg in [((doc, si, np.array([1, 2], np.int32), 3), "shuffle index"),
                      ((doc, si, np.array([1, 0], np.int32), 2), "document index names"),
                      ((doc, si + [[3, 0]], np.array([1, 0], np.int32), 3), "points outside"),
                      ((doc, si - 2, np.array([1, 0], np.int32), 3), "points outside"),
                      ((doc.astype(np.float32), si, np.array([1, 0], np.int32), 3), "int32")]:
        with pytest.raises(DataError, match=msg):
            check_gpt_indices(*args, "f.npy")


def test_without_a_compiler_the_reference_loop_runs(monkeypatch, tmp_path, capsys):
    for var in ("MEGAMOE_HELPER_DIR", "HOME"):
        monkeypatch.setenv(var, str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(blend_native, "_loaded", {})
    got = build_blending_indices([0.3, 0.7, 0.1], 500)
    want = reference_blending_indices([0.3, 0.7, 0.1], 500)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "using the slow Python loop" in err
