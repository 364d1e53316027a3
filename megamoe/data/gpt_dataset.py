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
from megamoe.data.gpt_indices import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    check_gpt_indices,
    epoch_stats,
    num_epochs_needed,
)
from megamoe.data.index_cache import DEFAULT_TIMEOUT_S, build_once, timed

__all__ = ["GPTDataset", "build_sample_index", "make_sample", "num_epochs_needed"]

_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
_INDEX_FORMAT = 1  # bump when the index construction changes


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
                 cache_dir: Optional[str] = None, name: str = "train",
                 wait_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.indexed = indexed
        self.seq_length = seq_length
        self.eod = eod
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.name = name
        document_ids = np.asarray(document_ids, dtype=np.int64)
        tokens_per_epoch = epoch_stats(document_ids, indexed.document_indices,
                                       indexed.sequence_lengths).tokens
        source = getattr(indexed, "path_prefix", None) or "mock"
        if tokens_per_epoch == 0:  # short splits are fine (more epochs); empty ones are not
            raise DataError(f"{source}: the {name} split's {len(document_ids)} documents hold "
                            "no tokens; use more data or change --split")
        self.description = {
            "class": "GPTDataset", "format": _INDEX_FORMAT, "source": _source_key(indexed),
            "split": name,
            "documents": hashlib.md5(np.ascontiguousarray(document_ids).data).hexdigest(),
            "num_documents": int(len(document_ids)), "tokens_per_epoch": tokens_per_epoch,
            "seq_length": seq_length, "num_samples": int(num_samples), "seed": int(seed),
        }
        self._cache_files: Optional[dict[str, str]] = None
        arrays = None
        what = (f"{name} indices of {source} ({len(document_ids)} documents, "
                f"{num_samples} samples of {seq_length})")
        if cache_dir is not None:
            arrays = self._load_or_build_cached(cache_dir, document_ids, tokens_per_epoch,
                                                num_samples, seed, what, wait_timeout_s)
        if arrays is None:
            with timed(what, always=False):
                arrays = self._build(document_ids, tokens_per_epoch, num_samples, seed)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def _build(self, document_ids, tokens_per_epoch, num_samples, seed):
        rng = np.random.RandomState(seed)
        epochs = num_epochs_needed(tokens_per_epoch, self.seq_length, num_samples)
        document_indices = np.asarray(self.indexed.document_indices)
        stats = epoch_stats(document_ids, document_indices, None)
        doc_index = build_document_index(document_ids, document_indices, epochs, rng,
                                         stats=stats)
        sample_index = build_sample_index(np.asarray(self.indexed.sequence_lengths),
                                          doc_index, self.seq_length,
                                          total_tokens=epochs * tokens_per_epoch)
        shuffle_index = build_shuffle_index(len(sample_index) - 1, rng)
        return doc_index, sample_index, shuffle_index

    def _load_or_build_cached(self, cache_dir, document_ids, tokens_per_epoch, num_samples,
                              seed, what, wait_timeout_s):
        """Built once per cache directory (build_once), memory-mapped back and checked."""
        key = hashlib.md5(json.dumps(self.description, sort_keys=True).encode()).hexdigest()
        stem = os.path.join(cache_dir, f"{key}-GPTDataset-{self.name}")
        files = {n: f"{stem}-{n}.npy" for n in _INDEX_NAMES}
        built = []

        def build() -> None:
            built.append(self._build(document_ids, tokens_per_epoch, num_samples, seed))
            _write_description(f"{stem}-description.json", self.description)
            for n, a in zip(_INDEX_NAMES, built[0]):
                save_npy_atomic(files[n], a)

        try:
            build_once(list(files.values()), build, what, wait_timeout_s)
        except OSError as e:
            sys.stderr.write(f"megamoe.data: warning: cannot write the index cache in "
                             f"{cache_dir} ({e.strerror or e}); indices kept in memory\n")
            return built[0] if built else None
        built.clear()
        self._cache_files = files
        arrays = _load_indices(files)
        check_gpt_indices(*arrays, len(self.indexed.sequence_lengths), files["sample_index"])
        return arrays

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
