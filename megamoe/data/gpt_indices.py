"""The three index arrays of a GPTDataset, built in bounded memory.

Semantics (Megatron's GPTDataset; gpt_dataset.py explains them): the document index is,
per epoch, a seeded permutation of the split's documents expanded to their sequence ids;
the sample index [N + 1, 2] holds (document-index position, token offset) of every sample
start i * S; the shuffle index is a seeded permutation of the samples.

Why chunked: a 10^8-document corpus has 10^8-entry indices, and whole-array NumPy
temporaries (int64 document ids, their lengths, the running token sum) cost several
times the output. Here each output is allocated once in its final dtype and filled
CHUNK entries at a time; permutations shuffle the output in place (RandomState.shuffle
draws the same numbers whatever the dtype, so the result equals rng.permutation's).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

CHUNK = 1 << 20  # entries per step: temporaries stay ~30 MB


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose token stream yields num_samples samples of seq_length + 1."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def expand_documents(document_indices: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Document ids -> their sequence ids, in order (`document_indices[d] .. [d+1]`)."""
    document_indices = np.asarray(document_indices)
    starts = document_indices[docs]
    counts = document_indices[docs + 1] - starts
    if np.all(counts == 1):  # the usual GPT corpus: one sequence per document
        return starts
    # Ragged expansion: sequence = its document's first sequence + rank within the doc.
    group_begin = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(int(counts.sum())) - group_begin)


def _chunks(n: int, chunk: int):
    return ((i, min(i + chunk, n)) for i in range(0, n, chunk))


class EpochStats(NamedTuple):
    sequences: int  # sequence ids one epoch spells out
    tokens: int  # their tokens (0 when the lengths were not given)
    top: int  # largest sequence id + 1 (0 when none)
    single: bool  # every document holds exactly one sequence
    identity: bool  # ... and its sequence id is its document id


def _is_range(ids: np.ndarray, chunk: int) -> bool:
    """ids == arange(ids[0], ids[0] + len(ids)) (what the split builder passes)."""
    n = len(ids)
    if n == 0 or int(ids[-1]) - int(ids[0]) != n - 1:
        return False
    return all(bool(np.all(np.diff(np.asarray(ids[a:min(b + 1, n)])) == 1))
               for a, b in _chunks(n, chunk))


def epoch_stats(document_ids: np.ndarray, document_indices: np.ndarray,
                sequence_lengths: Optional[np.ndarray], chunk: int = CHUNK) -> EpochStats:
    """What one epoch over `document_ids` holds, in bounded memory; a contiguous range of
    documents (the usual split) is read as slices, without gathers."""
    document_indices = np.asarray(document_indices)
    if _is_range(document_ids, chunk):
        b, e = int(document_ids[0]), int(document_ids[-1]) + 1
        first, last = int(document_indices[b]), int(document_indices[e])
        # documents b .. e-1 hold sequences document_indices[d] .. [d + 1]
        single = last - first == e - b and all(
            bool(np.all(np.diff(document_indices[b + x:b + y + 1]) == 1))
            for x, y in _chunks(e - b, chunk))
        tokens = 0 if sequence_lengths is None else sum(
            int(np.asarray(sequence_lengths[a:c]).sum(dtype=np.int64))
            for a, c in ((x + first, y + first) for x, y in _chunks(last - first, chunk)))
        return EpochStats(last - first, tokens, last if last > first else 0, single,
                          single and first == b)
    sequences = tokens = top = 0
    single = identity = True
    for a, b in _chunks(len(document_ids), chunk):
        docs = np.asarray(document_ids[a:b])
        starts, ends = document_indices[docs], document_indices[docs + 1]
        counts = ends - starts
        sequences += int(counts.sum())
        single = single and bool(np.all(counts == 1))
        identity = identity and single and bool(np.all(starts == docs))
        if counts.any():
            top = max(top, int(ends[counts > 0].max()))
        if sequence_lengths is None:
            continue
        seq_ids = starts if single else expand_documents(document_indices, docs)
        tokens += int(np.asarray(sequence_lengths)[seq_ids].sum(dtype=np.int64))
    return EpochStats(sequences, tokens, top, single, identity)


def build_document_index(document_ids: np.ndarray, document_indices: np.ndarray,
                         num_epochs: int, rng: np.random.RandomState,
                         chunk: int = CHUNK, stats: Optional[EpochStats] = None) -> np.ndarray:
    """Sequence ids in stream order: per epoch a permutation of `document_ids`, each
    document expanded to its sequences (kept together, in order). `stats`: epoch_stats
    of these documents, when the caller has them already."""
    document_indices = np.asarray(document_indices)
    n_docs = len(document_ids)
    if stats is None:
        stats = epoch_stats(document_ids, document_indices, None, chunk)
    per_epoch = stats.sequences
    out = np.empty(num_epochs * per_epoch, dtype=np.int32 if stats.top <= 2**31 else np.int64)
    top_doc = int(np.max(document_ids)) if n_docs else 0
    docs_dtype = np.int32 if top_doc < 2**31 else np.int64
    in_place = stats.single and top_doc <= np.iinfo(out.dtype).max
    for e in range(num_epochs):
        if in_place:  # shuffle the document ids in place, then map them to sequence ids
            epoch = out[e * per_epoch:(e + 1) * per_epoch]
            epoch[:] = document_ids
            rng.shuffle(epoch)
            for a, b in _chunks(0 if stats.identity else n_docs, chunk):
                epoch[a:b] = document_indices[epoch[a:b]]
            continue
        docs = np.asarray(document_ids, dtype=docs_dtype).copy()
        rng.shuffle(docs)
        at = e * per_epoch
        for a, b in _chunks(n_docs, chunk):
            seq = expand_documents(document_indices, docs[a:b])
            out[at:at + len(seq)] = seq
            at += len(seq)
    return out


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       seq_length: int, chunk: int = CHUNK,
                       total_tokens: Optional[int] = None) -> np.ndarray:
    """[N + 1, 2] (document-index position, offset) of every sample start i * seq_length:
    the first stream position whose end lies beyond the start (skips empty sequences).
    `total_tokens`: the stream's length, when the caller knows it (saves a pass)."""
    n_pos = len(document_index)
    total = total_tokens if total_tokens is not None else sum(
        int(sequence_lengths[document_index[a:b]].sum(dtype=np.int64))
        for a, b in _chunks(n_pos, chunk))
    num_samples = (total - 1) // seq_length if total > 0 else 0
    out = np.zeros((num_samples + 1, 2), dtype=np.int32 if n_pos < 2**31 else np.int64)
    base = placed = 0  # tokens before the chunk; samples placed so far
    for a, b in _chunks(n_pos, chunk):
        lengths = sequence_lengths[document_index[a:b]].astype(np.int64)
        ends = base + np.cumsum(lengths)
        end = int(ends[-1])
        last = min(num_samples, (end - 1) // seq_length) if end > 0 else -1
        if last >= placed:  # samples placed .. last start in [base, end)
            starts = np.arange(placed, last + 1, dtype=np.int64) * seq_length
            pos = np.searchsorted(ends, starts, side="right")
            out[placed:last + 1, 0] = pos + a
            out[placed:last + 1, 1] = starts - (ends[pos] - lengths[pos])
            placed = last + 1
        base = end
    return out


def build_shuffle_index(num_samples: int, rng: np.random.RandomState) -> np.ndarray:
    """rng.permutation(num_samples) in int32 where it fits, shuffled in place."""
    out = np.arange(num_samples, dtype=np.int32 if num_samples < 2**31 else np.int64)
    rng.shuffle(out)
    return out


def _bounds(a: np.ndarray, lo: int, hi: int, chunk: int) -> bool:
    """Every entry of `a` in [lo, hi), read chunk by chunk (it may be memory-mapped)."""
    for s, e in _chunks(len(a), chunk):
        block = np.asarray(a[s:e])
        if block.size and (int(block.min()) < lo or int(block.max()) >= hi):
            return False
    return True


def check_gpt_indices(document_index: np.ndarray, sample_index: np.ndarray,
                      shuffle_index: np.ndarray, num_sequences: int, source: str,
                      chunk: int = CHUNK) -> None:
    """Cached indices are untrusted: integer dtypes, shapes, and every entry in range
    (sequence ids, document-index positions, sample ids), so a corrupt or foreign file
    fails here with its name rather than as a wild read later."""
    from megamoe.data.errors import DataError

    def bad(what: str) -> DataError:
        return DataError(f"{source}: {what}; delete the cache directory to rebuild it")

    arrays = (document_index, sample_index, shuffle_index)
    if any(a.dtype not in (np.int32, np.int64) for a in arrays):
        raise bad("index cache arrays must be int32 or int64")
    if (document_index.ndim != 1 or sample_index.ndim != 2 or sample_index.shape[1] != 2
            or len(sample_index) < 1 or shuffle_index.ndim != 1):
        raise bad("index cache arrays have the wrong shapes")
    n = len(sample_index) - 1
    if len(shuffle_index) != n or not _bounds(shuffle_index, 0, n, chunk):
        raise bad(f"shuffle index is not over the {n} samples")
    if not _bounds(document_index, 0, num_sequences, chunk):
        raise bad(f"document index names sequences outside [0, {num_sequences})")
    if not _bounds(sample_index[:, 0], 0, max(len(document_index), 1), chunk):
        raise bad("sample index points outside the document index")
    if not _bounds(sample_index[:, 1], 0, 2**62, chunk):
        raise bad("sample index has negative offsets")
