"""Tokenizers under Megatron-LM's `--tokenizer-type` names.

Every tokenizer exposes `.vocab_size` (including special tokens: the model's embedding
size before padding), `.eod` (the end-of-document id that preprocessing appends and
`--eod-mask-loss` masks), `.tokenize(text) -> list[int]` and `.detokenize(ids) -> str`.
Missing or unreadable files raise DataError naming the file.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from megamoe.config.data import TOKENIZER_TYPES
from megamoe.data.errors import DataError
from megamoe.data.remote_tokenizer import load_remote_code_tokenizer

# End-of-document spellings tried, in order, when a tokenizer.json does not name its eos.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>",
                   "<|im_end|>", "[SEP]")


def _require_file(path: Optional[str], flag: str, kind: str) -> str:
    if path is None:
        raise DataError(f"{kind} needs {flag}")
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found ({flag})")
    return path


class SentencePieceTokenizer:
    """A sentencepiece model file; Megatron's GPTSentencePieceTokenizer behaviour.

    eod is the model's eos id. A model trained without eos adds no token: eod falls back
    to its pad id, else its unk id (documents are then separated by that id; training
    with tools/train_tokenizer.py always includes eos). vocab_size is the piece count.
    """

    def __init__(self, model_file: str) -> None:
        import sentencepiece as spm

        self.model_file = model_file
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{model_file}: not a sentencepiece model ({_one_line(e)})") from None
        self.vocab_size = int(self._sp.get_piece_size())
        self.bos = int(self._sp.bos_id())
        for candidate in (self._sp.eos_id(), self._sp.pad_id(), self._sp.unk_id()):
            if candidate >= 0:
                self.eod = int(candidate)
                break
        else:
            raise DataError(f"{model_file}: model has no eos, pad or unk id to use as eod")

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __getstate__(self) -> dict:  # the C++ processor does not pickle; reload by path
        return {"model_file": self.model_file}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_file"])


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's Llama2Tokenizer: sentencepiece, but every text starts with bos.

    Like Megatron, `tokenize` prepends the model's bos id (when it has one) and appends
    nothing; eod is the eos id. `detokenize` drops control tokens such as bos.
    """

    def tokenize(self, text: str) -> list[int]:
        ids = list(self._sp.encode(text))
        return [self.bos, *ids] if self.bos >= 0 else ids


class HuggingFaceTokenizer:
    """A `tokenizers` tokenizer.json (or a directory holding one, e.g. a HF model repo).

    eod is the eos token named by a sibling tokenizer_config.json when present, else the
    first of the common end-of-text spellings found in the vocabulary. tokenize applies
    the tokenizer's own post-processor (as Megatron's HF wrapper does, e.g. Llama's bos);
    detokenize skips special tokens.
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise DataError(f"{file}: file not found (--tokenizer-model)")
        self.path = path
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise DataError(f"{file}: not a tokenizers JSON file ({_one_line(e)})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        names = [_configured_eos(os.path.dirname(file)), *_EOS_CANDIDATES]
        for name in names:
            if name is not None and name in vocab:
                self.eod = int(vocab[name])
                break
        else:
            tried = ", ".join(_EOS_CANDIDATES)
            raise DataError(f"{file}: no end-of-text token found (tried {tried}; or name "
                            "eos_token in tokenizer_config.json)")

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`tokenize` of each text, encoded together (the Rust library's own threads)."""
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def _configured_eos(directory: str) -> Optional[str]:
    cfg = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(cfg):
        return None
    try:
        with open(cfg, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError) as e:
        raise DataError(f"{cfg}: unreadable tokenizer config ({_one_line(e)})") from None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE from vocab.json + merges.txt; eod = `<|endoftext|>`."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
        except (OSError, ValueError) as e:
            raise DataError(f"{vocab_file}: not a JSON vocabulary ({_one_line(e)})") from None
        if not isinstance(vocab, dict) or "<|endoftext|>" not in vocab:
            raise DataError(f"{vocab_file}: vocabulary has no <|endoftext|> token")
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # tokenizers raises a bare Exception on bad merges
            raise DataError(f"{merge_file}: unreadable BPE merges ({_one_line(e)})") from None
        self._tok = Tokenizer(model)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_size = len(vocab)
        self.eod = int(vocab["<|endoftext|>"])

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class NullTokenizer:
    """Megatron's NullTokenizer (megatron/core/tokenizers/text/libraries/null_tokenizer.py):
    text is already space-separated token ids; `--vocab-size` ids in all, EOD = vocab_size
    - 1 unless --null-tokenizer-eod-id names another (megamoe once had vocab_size + 1 ids
    with EOD = vocab_size; Megatron's current count is what runs now).
    """

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None) -> None:
        if vocab_size is None or int(vocab_size) < 1:
            raise DataError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= self.eod < self.vocab_size:
            raise DataError(f"--null-tokenizer-eod-id must be in [0, --vocab-size "
                            f"({self.vocab_size})), got {eod_id}")

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise DataError("NullTokenizer input must be space-separated integers") from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(tokenizer_type: str, *, tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    vocab_size: Optional[int] = None, null_eod_id: Optional[int] = None,
                    trust_remote_code: bool = False):
    """The tokenizer for a Megatron `--tokenizer-type` and its files; a HuggingFaceTokenizer
    directory that is its own Python code runs it only with `trust_remote_code`
    (data/remote_tokenizer.py)."""
    if tokenizer_type in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        path = _require_file(tokenizer_model, "--tokenizer-model", tokenizer_type)
        cls = SentencePieceTokenizer if tokenizer_type == "SentencePieceTokenizer" else (
            Llama2Tokenizer)
        return cls(path)
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise DataError("HuggingFaceTokenizer needs --tokenizer-model")
        if not os.path.exists(tokenizer_model):
            raise DataError(f"{tokenizer_model}: file not found (--tokenizer-model)")
        if os.path.isdir(tokenizer_model):
            remote = load_remote_code_tokenizer(tokenizer_model, trust_remote_code)
            if remote is not None:
                return remote
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_require_file(vocab_file, "--vocab-file", tokenizer_type),
                                _require_file(merge_file, "--merge-file", tokenizer_type))
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size, null_eod_id)
    raise DataError(f"unknown --tokenizer-type {tokenizer_type!r} "
                    f"(expected one of {', '.join(TOKENIZER_TYPES)})")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
