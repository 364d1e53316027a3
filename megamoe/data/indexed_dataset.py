"""Megatron-LM's memory-mapped indexed dataset (`.bin` tokens + `.idx` index).

Byte-compatible with Megatron-LM so corpora preprocessed by either project load in the
other. The `.idx` layout (little endian):

    b"MMIDIDX\\x00\\x00"     9-byte magic
    <Q  version (1)
    <B  dtype code (see DTYPE_CODES)
    <Q  sequence count N
    <Q  document count D (length of document_indices, including its leading 0)
    int32[N]  sequence lengths (tokens)
    int64[N]  sequence byte offsets into .bin
    int64[D]  document_indices: document boundaries as sequence indices, starting at 0

The `.bin` file is the sequences' tokens back to back in the dtype.
"""

from __future__ import annotations

import os
import struct
from typing import Optional, Sequence, Union

import numpy as np

from megamoe.data.atomic import publish, remove_quietly, tmp_path_for
from megamoe.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8


def dtype_code(dtype) -> int:
    """Megatron's code for a numpy dtype."""
    for code, dt in DTYPE_CODES.items():
        if np.dtype(dt) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {dtype} has no indexed-dataset code")


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """Megatron's choice: uint16 when every token id fits comfortably, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


class IndexedDatasetBuilder:
    """Streams sequences into `bin_path` (via a temporary file) and writes the index.

    Nothing appears at `bin_path`/`idx_path` until `finalize`, which publishes both files
    by rename: an interrupted build leaves any previous dataset intact. Use as a context
    manager (or call `abort`) to delete the temporary file when the build fails.
    """

    def __init__(self, bin_path: str, dtype=np.int32) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # reject dtypes Megatron cannot describe
        self._tmp_bin: Optional[str] = tmp_path_for(bin_path)
        self._file = open(self._tmp_bin, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens: Union[Sequence[int], np.ndarray]) -> None:
        """Append one sequence to the current document."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if arr.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {arr.shape}")
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the last end)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Union[Sequence[int], np.ndarray],
                     lengths: Optional[Sequence[int]] = None) -> None:
        """Append a whole document: `tokens` flat, split into sequences of `lengths`."""
        arr = np.asarray(tokens, dtype=self.dtype).reshape(-1)
        lengths = [arr.size] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != arr.size or any(n < 0 for n in lengths):
            raise ValueError(f"sequence lengths {lengths} do not cover {arr.size} tokens")
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.end_document()

    def add_packed(self, tokens: bytes, sequence_lengths: np.ndarray,
                   document_sequences: np.ndarray) -> None:
        """Append whole documents already packed in this dtype (a preprocessing worker's
        output): `document_sequences[d]` sequences of `sequence_lengths` each."""
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        if int(lengths.sum()) * self.dtype.itemsize != len(tokens):
            raise ValueError("packed tokens do not match their sequence lengths")
        self._file.write(tokens)
        self.sequence_lengths.extend(lengths.tolist())
        base = self.document_indices[-1]
        self.document_indices.extend((base + np.cumsum(document_sequences)).tolist())

    def add_index(self, path_prefix: str) -> None:
        """Append a whole finished dataset (Megatron's add_index: tools/merge_datasets.py
        and --partitions); its dtype must be this builder's."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise DataError(f"{index_file_path(path_prefix)}: dtype {other.dtype} differs "
                            f"from the merged dataset's {self.dtype}")
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((base + other.document_indices[1:]).tolist())
        with open(data_file_path(path_prefix), "rb") as f:
            while block := f.read(16 << 20):
                self._file.write(block)

    def finalize(self, idx_path: str) -> None:
        """Write the index and publish `.bin` then `.idx` atomically."""
        self._file.close()
        tmp_idx = tmp_path_for(idx_path)
        try:
            with open(tmp_idx, "wb") as f:
                f.write(_pack_index(self.dtype, self.sequence_lengths, self.document_indices))
            publish(self._tmp_bin, self.bin_path)
            self._tmp_bin = None
            publish(tmp_idx, idx_path)
        except BaseException:
            remove_quietly(tmp_idx)
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the partial data file; the target paths are left untouched."""
        if not self._file.closed:
            self._file.close()
        remove_quietly(self._tmp_bin)
        self._tmp_bin = None

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._tmp_bin is not None:  # failed or never finalized
            self.abort()


def _pack_index(dtype: np.dtype, sequence_lengths: Sequence[int],
                document_indices: Sequence[int]) -> bytes:
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    header = MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", dtype_code(dtype))
    header += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(docs))
    return header + lengths.tobytes() + pointers.tobytes() + docs.tobytes()


class IndexedDataset:
    """Read-only view of `{path_prefix}.bin/.idx`, both memory-mapped; with
    `mmap_bin=False` (Megatron's --no-mmap-bin-files) the .bin is not mapped and each
    read is one positioned file read into a fresh array (Megatron's _FileBinReader), for
    file systems where mapping large files is slow or not allowed.

    Validates the whole index on open (magic, version, dtype, sizes, offsets, document
    boundaries) so corruption fails here with a DataError instead of as garbage tokens
    in the middle of a run. Pickles by path, so DataLoader workers re-map the files
    instead of copying them.
    """

    def __init__(self, path_prefix: str, mmap_bin: bool = True) -> None:
        self.path_prefix, self.mmap_bin = path_prefix, mmap_bin
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise DataError(f"{p}: file not found")
        idx_size = os.path.getsize(idx_path)

        def bad(what: str) -> DataError:
            return DataError(f"{idx_path}: corrupt Megatron index: {what}")

        if idx_size < _HEADER_SIZE:
            raise bad(f"{idx_size} bytes is shorter than the {_HEADER_SIZE}-byte header")
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER_SIZE)
        if header[: len(MAGIC)] != MAGIC:
            raise bad(f"bad magic {header[:len(MAGIC)]!r} (expected {MAGIC!r})")
        off = len(MAGIC)
        (version,) = struct.unpack_from("<Q", header, off)
        if version != VERSION:
            raise bad(f"unsupported version {version} (expected {VERSION})")
        (code,) = struct.unpack_from("<B", header, off + 8)
        if code not in DTYPE_CODES:
            raise bad(f"unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc = struct.unpack_from("<QQ", header, off + 9)
        expected = _HEADER_SIZE + n_seq * (4 + 8) + n_doc * 8
        if idx_size != expected:
            raise bad(f"{idx_size} bytes but {n_seq} sequences and {n_doc} document entries "
                      f"need {expected}")
        if n_doc < 1:
            raise bad("no document boundaries (document_indices must start with 0)")
        self._idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        buf = self._idx_map
        self.sequence_lengths = np.frombuffer(buf, np.int32, n_seq, _HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(buf, np.int64, n_seq, _HEADER_SIZE + n_seq * 4)
        self.document_indices = np.frombuffer(buf, np.int64, n_doc, _HEADER_SIZE + n_seq * 12)

        if n_seq and int(self.sequence_lengths.min()) < 0:
            raise bad("negative sequence length")
        pointers = np.zeros(n_seq, dtype=np.int64)
        if n_seq > 1:
            np.cumsum(self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize,
                      out=pointers[1:])
        if not np.array_equal(pointers, self.sequence_pointers):
            raise bad("sequence pointers do not match the sequence lengths")
        docs = self.document_indices
        if docs[0] != 0 or docs[-1] != n_seq or (n_doc > 1 and np.any(np.diff(docs) < 0)):
            raise bad("document indices must rise from 0 to the sequence count")
        n_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bin_size = os.path.getsize(bin_path)
        if bin_size != n_tokens * self.dtype.itemsize:
            raise DataError(f"{bin_path}: {bin_size} bytes but {idx_path} describes {n_tokens} "
                            f"{self.dtype.name} tokens ({n_tokens * self.dtype.itemsize} bytes); "
                            "truncated or mismatched files")
        self._bin_path, self._bin_map = bin_path, None
        if bin_size and self.mmap_bin:
            self._bin_map = np.memmap(bin_path, mode="r", dtype=self.dtype)
        elif not bin_size:  # mmap cannot map an empty file
            self._bin_map = np.zeros(0, dtype=self.dtype)

    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix, "mmap_bin": self.mmap_bin}

    def __setstate__(self, state: dict) -> None:
        self.path_prefix, self.mmap_bin = state["path_prefix"], state.get("mmap_bin", True)
        self._open()

    def _read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the .bin: a view of the map, or (no mmap) one
        positioned read that opens the file each time (safe across forked workers)."""
        if self._bin_map is not None:
            return self._bin_map[start:start + length]
        out = np.empty(length, dtype=self.dtype)
        with open(self._bin_path, "rb", buffering=0) as f:
            f.seek(start * self.dtype.itemsize)
            got = f.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise DataError(f"{self._bin_path}: short read ({got} of {out.nbytes} bytes); "
                            "the file changed after it was opened")
        return out

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def max_token_id(self) -> int:
        """Largest token in the file (a full scan; -1 when empty)."""
        if self._bin_map is None:  # (no mmap) in chunks, never the whole file at once
            chunk, n, top = 1 << 24, self.num_tokens, -1
            for start in range(0, n, chunk):
                top = max(top, int(self._read(start, min(chunk, n - start)).max()))
            return top
        return int(self._bin_map.max()) if self._bin_map.size else -1

    def __getitem__(self, idx: Union[int, slice]) -> Union[np.ndarray, list[np.ndarray]]:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end if no length)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences")
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} "
                             f"of length {seq_len}")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._read(start, length)
