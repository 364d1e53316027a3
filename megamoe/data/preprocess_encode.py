"""The worker side of tools/preprocess_data.py: one chunk of documents -> packed tokens.

Megatron's Encoder.encode, per chunk instead of per document: a value that is a list is
a document of sentences (each a sequence), a string is a one-sequence document; empty
sequences are dropped and --append-eod adds eod to the last sequence of a non-empty
document. With --split-sentences each string is first split into sentences by
Megatron's nltk punkt calls (megamoe/data/sentence_split.py). Why per chunk: the texts
of a chunk go to the tokenizer in one batch (tokenizers' encode_batch) and come back as
one bytes object in the output dtype, so the main process writes them with no
per-token Python work.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import numpy as np

from megamoe.data.errors import DataError
from megamoe.data.sentence_split import load_splitter, split_text


@dataclass(frozen=True)
class EncodeConfig:
    keys: tuple[str, ...]
    append_eod: bool
    dtype: str  # numpy dtype name of the output tokens
    split_sentences: bool = False
    lang: str = "english"
    keep_newlines: bool = False


@dataclass
class EncodedChunk:
    """One chunk's documents; `packed[key]` = (token bytes, sequence lengths int64,
    sequences per document int64). `error` is "LOCATION: what" for bad input."""

    n_docs: int
    packed: dict
    error: str = ""


_STATE: dict = {}  # per worker process: the tokenizer, EncodeConfig, sentence splitter


def init_worker(tokenizer_factory, cfg: EncodeConfig) -> None:
    _STATE["tokenizer"] = tokenizer_factory()
    _STATE["cfg"] = cfg
    _STATE["splitter"], _STATE["init_error"] = None, ""
    if cfg.split_sentences:
        # an initializer that raises makes multiprocessing.Pool restart the worker without
        # end (Megatron's run hangs so): the error goes back with the first chunk instead
        try:
            _STATE["splitter"] = load_splitter(cfg.lang, cfg.keep_newlines)
        except DataError as e:
            _STATE["init_error"] = str(e)


def _documents(chunk: tuple, keys: tuple[str, ...], strings: bool) -> tuple[dict, str]:
    """{key: [value per document]} from a chunk, or ({}, error). `strings`: a value must
    be a string (--split-sentences: Megatron's split of a list fails)."""
    kind, first, payload = chunk
    if kind == "rows":
        for key, values in payload.items():
            for j, v in enumerate(values):
                if not _is_text(v, strings):
                    return {}, f"row {first + j}: column {key!r} is {_what(v)}"
        return payload, ""
    out: dict = {k: [] for k in keys}
    for j, line in enumerate(payload):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as e:
            return {}, f"line {first + j}: invalid JSON ({e})"
        if not isinstance(doc, dict):
            return {}, f"line {first + j}: expected a JSON object"
        for key in keys:
            if key not in doc:
                return {}, f"line {first + j}: key {key!r} missing"
            if not _is_text(doc[key], strings):
                return {}, f"line {first + j}: key {key!r} is {_what(doc[key])}"
            out[key].append(doc[key])
    return out, ""


def _is_text(v, strings: bool = False) -> bool:
    if strings:
        return isinstance(v, str)
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _what(v) -> str:
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return "a list of sentences (--split-sentences needs one string per document)"
    return "null" if v is None else f"not a string or list of strings ({type(v).__name__})"


def _tokenize_all(tokenizer, texts: list[str]) -> list[list[int]]:
    batch = getattr(tokenizer, "tokenize_batch", None)
    return batch(texts) if batch is not None else [tokenizer.tokenize(t) for t in texts]


def _pack(tokenizer, values: list, append_eod: bool, dtype: np.dtype) -> tuple:
    docs = [v if isinstance(v, list) else [v] for v in values]
    flat = _tokenize_all(tokenizer, [s for d in docs for s in d])
    seqs: list[list[int]] = []
    per_doc = np.zeros(len(docs), dtype=np.int64)
    at = 0
    for d, sentences in enumerate(docs):
        kept = [ids for ids in flat[at:at + len(sentences)] if len(ids) > 0]
        at += len(sentences)
        if kept and append_eod:
            kept[-1] = [*kept[-1], tokenizer.eod]
        seqs.extend(kept)
        per_doc[d] = len(kept)
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64,
                         count=int(lengths.sum()))
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > np.iinfo(dtype).max):
        raise DataError(f"token id out of range for {dtype}")
    return tokens.astype(dtype).tobytes(), lengths, per_doc


def encode_chunk(chunk: tuple) -> EncodedChunk:
    """Tokenize every document of `chunk` with this worker's tokenizer."""
    cfg: EncodeConfig = _STATE["cfg"]
    if _STATE["init_error"]:
        return EncodedChunk(0, {}, _STATE["init_error"])
    splitter = _STATE["splitter"]
    values, error = _documents(chunk, cfg.keys, strings=cfg.split_sentences)
    if error:
        return EncodedChunk(0, {}, error)
    if splitter is not None:  # Megatron's Encoder.split, then encode of the sentences
        values = {k: [split_text(splitter, v) for v in docs] for k, docs in values.items()}
    n_docs = len(values[cfg.keys[0]])
    packed = {}
    try:
        for key in cfg.keys:
            packed[key] = _pack(_STATE["tokenizer"], values[key], cfg.append_eod,
                                np.dtype(cfg.dtype))
    except DataError as e:
        where = "line" if chunk[0] == "json" else "row"
        return EncodedChunk(0, {}, f"{where}s from {chunk[1]}: {e}")
    return EncodedChunk(n_docs, packed)
