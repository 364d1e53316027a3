"""Megatron's GPTDataset: fixed-length samples cut from a shuffled stream of documents.

Three index arrays define the samples (Megatron semantics):

- document index: per epoch, a seeded permutation of the split's documents, expanded to
  their sequence ids (a document's sequences stay together and in order). As many epochs
  as `num_samples` needs.
- sample index [N + 1, 2]: sample i starts at token position i * S of the stream the
  document index spells out, stored as (position in the document index, token offset).
  A sample reads S + 1 tokens, so consecutive samples share one boundary token (the
  label of the last input position).
- shuffle index [N]: a seeded permutation of the samples.

They depend only on the data, the split, S, num_samples and the seed, so they are cached
as .npy files keyed by a hash of exactly those, written atomically and memory-mapped back:
every rank and every rerun reads identical indices.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Optional

import numpy as np
import torch

from megamoe.data.atomic import save_npy_atomic, tmp_path_for
from megamoe.data.errors import DataError

_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
_INDEX_FORMAT = 1  # bump when the index construction changes


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


def build_document_index(document_ids: np.ndarray, document_indices: np.ndarray,
                         num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """Sequence ids in stream order: per epoch a permutation of `document_ids`, each
    document expanded to its sequences (kept together, in order)."""
    per_epoch = [rng.permutation(document_ids) for _ in range(num_epochs)]
    docs = np.concatenate(per_epoch) if per_epoch else np.zeros(0, dtype=np.int64)
    seq_ids = expand_documents(document_indices, docs)
    dtype = np.int32 if seq_ids.size == 0 or seq_ids.max() < 2**31 else np.int64
    return seq_ids.astype(dtype)


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       seq_length: int) -> np.ndarray:
    """[N + 1, 2] (document-index position, offset) of every sample start i * seq_length."""
    lengths = sequence_lengths[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    num_samples = (total - 1) // seq_length if total > 0 else 0
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # First stream position whose end lies beyond the start: skips empty sequences.
    pos = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[pos] - lengths[pos])
    dtype = np.int32 if len(document_index) < 2**31 else np.int64
    return np.stack([pos, offset], axis=1).astype(dtype)


def build_shuffle_index(num_samples: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.int32 if num_samples < 2**31 else np.int64
    return rng.permutation(num_samples).astype(dtype)


class GPTDataset(torch.utils.data.Dataset):
    """Samples of `seq_length` tokens from the documents `document_ids` of `indexed`.

    `indexed` is an IndexedDataset or anything with the same `sequence_lengths`,
    `document_indices` and `get` (the mock dataset). Items are dicts of tensors
    `tokens`, `labels` (int64 [S]), `loss_mask` (float32 [S]) and `position_ids` [S].
    Length = every sample the needed epochs provide (>= num_samples).
    """

    def __init__(self, indexed, document_ids: np.ndarray, num_samples: int, seq_length: int,
                 seed: int, eod: int, *, eod_mask_loss: bool = False,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False,
                 cache_dir: Optional[str] = None,
                 name: str = "train") -> None:
        self.indexed = indexed
        self.seq_length = seq_length
        self.eod = eod
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.name = name
        document_ids = np.asarray(document_ids, dtype=np.int64)
        seq_ids = expand_documents(indexed.document_indices, document_ids)
        tokens_per_epoch = int(indexed.sequence_lengths[seq_ids].sum(dtype=np.int64))
        source = getattr(indexed, "path_prefix", None) or "mock"
        if tokens_per_epoch == 0:  # short splits are fine (more epochs); empty ones are not
            raise DataError(f"{source}: the {name} split's {len(document_ids)} documents hold "
                            "no tokens; use more data or change --split")
        self.description = {
            "class": "GPTDataset", "format": _INDEX_FORMAT, "source": _source_key(indexed),
            "split": name,
            "documents": hashlib.md5(document_ids.tobytes()).hexdigest(),
            "num_documents": int(len(document_ids)), "tokens_per_epoch": tokens_per_epoch,
            "seq_length": seq_length, "num_samples": int(num_samples), "seed": int(seed),
        }
        self._cache_files: Optional[dict[str, str]] = None
        arrays = None
        if cache_dir is not None:
            arrays = self._load_or_build_cached(cache_dir, document_ids, tokens_per_epoch,
                                                num_samples, seed)
        if arrays is None:
            arrays = self._build(document_ids, tokens_per_epoch, num_samples, seed)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def _build(self, document_ids, tokens_per_epoch, num_samples, seed):
        rng = np.random.RandomState(seed)
        epochs = num_epochs_needed(tokens_per_epoch, self.seq_length, num_samples)
        doc_index = build_document_index(document_ids, np.asarray(
            self.indexed.document_indices), epochs, rng)
        sample_index = build_sample_index(np.asarray(self.indexed.sequence_lengths),
                                          doc_index, self.seq_length)
        shuffle_index = build_shuffle_index(len(sample_index) - 1, rng)
        return doc_index, sample_index, shuffle_index

    def _load_or_build_cached(self, cache_dir, document_ids, tokens_per_epoch, num_samples,
                              seed):
        key = hashlib.md5(json.dumps(self.description, sort_keys=True).encode()).hexdigest()
        files = {n: os.path.join(cache_dir, f"{key}-GPTDataset-{self.name}-{n}.npy")
                 for n in _INDEX_NAMES}
        if not all(os.path.isfile(p) for p in files.values()):
            arrays = self._build(document_ids, tokens_per_epoch, num_samples, seed)
            try:
                os.makedirs(cache_dir, exist_ok=True)
                _write_description(os.path.join(cache_dir, f"{key}-GPTDataset-{self.name}"
                                                "-description.json"), self.description)
                for n, a in zip(_INDEX_NAMES, arrays):
                    save_npy_atomic(files[n], a)
            except OSError as e:
                sys.stderr.write(f"megamoe.data: warning: cannot write the index cache in "
                                 f"{cache_dir} ({e.strerror}); indices kept in memory\n")
                return arrays
        self._cache_files = files
        return _load_indices(files)

    def __getstate__(self) -> dict:
        """Pickle cached indices by path so DataLoader workers map instead of copy them."""
        state = dict(self.__dict__)
        if self._cache_files is not None:
            for n in _INDEX_NAMES:
                state.pop(n)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._cache_files is not None:
            arrays = _load_indices(self._cache_files)
            self.document_index, self.sample_index, self.shuffle_index = arrays

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample `idx` (after shuffling)."""
        j = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        get, doc_index = self.indexed.get, self.document_index
        if d0 == d1:
            return np.asarray(get(int(doc_index[d0]), o0, o1 - o0 + 1), dtype=np.int64)
        parts = [get(int(doc_index[d0]), o0)]
        parts += [get(int(doc_index[d])) for d in range(d0 + 1, d1)]
        parts.append(get(int(doc_index[d1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return make_sample(self.sample_tokens(idx), self.eod, self.eod_mask_loss,
                           self.reset_position_ids, self.reset_attention_mask)


def make_sample(text: np.ndarray, eod: int, eod_mask_loss: bool,
                reset_position_ids: bool, reset_attention_mask: bool = False
                ) -> dict[str, torch.Tensor]:
    """S + 1 tokens -> the training dict (inputs, next-token labels, mask, positions; with
    `reset_attention_mask` also `document_ids` [S]: a document starts after every eod, the
    eod itself ends the previous one, as Megatron's get_ltor_masks_and_position_ids cuts
    its attention mask; attention keeps a token to the keys of its own document)."""
    tokens_S = torch.from_numpy(np.ascontiguousarray(text[:-1], dtype=np.int64))
    labels_S = torch.from_numpy(np.ascontiguousarray(text[1:], dtype=np.int64))
    seq = tokens_S.numel()
    # Samples are made on the host (DataLoader workers); the trainer moves them.
    loss_mask_S = torch.ones(seq, dtype=torch.float32, device="cpu")
    if eod_mask_loss:
        loss_mask_S[tokens_S == eod] = 0.0
    position_ids_S = torch.arange(seq, dtype=torch.int64, device="cpu")  # host sample
    if reset_position_ids:  # restart positions after every eod, as Megatron does
        starts = torch.zeros(seq, dtype=torch.int64, device="cpu")  # host sample
        after_eod = torch.nonzero(tokens_S[:-1] == eod).flatten() + 1
        starts[after_eod] = after_eod
        position_ids_S = position_ids_S - torch.cummax(starts, dim=0).values
    sample = {"tokens": tokens_S, "labels": labels_S, "loss_mask": loss_mask_S,
              "position_ids": position_ids_S}
    if reset_attention_mask:
        sample["document_ids"] = document_ids(tokens_S, eod)
    return sample


def document_ids(tokens_S: torch.Tensor, eod: int) -> torch.Tensor:
    """int64 [S]: how many eods come strictly before each position (its document)."""
    is_eod = (tokens_S == eod).to(torch.int64)
    return torch.cumsum(is_eod, dim=0) - is_eod


def _source_key(indexed) -> dict:
    """What the indices depend on: the index file's bytes (sequence lengths and document
    boundaries, never the tokens), or the mock's recipe."""
    prefix = getattr(indexed, "path_prefix", None)
    if prefix is None:
        return dict(getattr(indexed, "description", {}))
    digest = hashlib.md5()
    with open(prefix + ".idx", "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return {"path": os.path.abspath(prefix), "idx_md5": digest.hexdigest()}


def _load_indices(files: dict[str, str]) -> tuple[np.ndarray, ...]:
    try:
        return tuple(np.load(files[n], mmap_mode="r", allow_pickle=False) for n in _INDEX_NAMES)
    except (OSError, ValueError) as e:
        raise DataError(f"{files['document_index']}: unreadable index cache ({e}); delete the "
                        "cache directory to rebuild it") from None


def _write_description(path: str, description: dict) -> None:
    tmp = tmp_path_for(path)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(description, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
