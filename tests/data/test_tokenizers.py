"""Each --tokenizer-type round-trips text and has the right eod and vocab size."""

from __future__ import annotations

import json
import shutil

import pytest

from megamoe.data import DataError, build_tokenizer

TEXT = "To be, or not to be: the question.\nOr to take arms"


def test_sentencepiece(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    ids = tok.tokenize(TEXT)
    assert tok.detokenize(ids) == TEXT  # newline and punctuation survive
    assert tok.vocab_size == 320 and tok.eod == 2 and tok.eod not in ids
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(tok.tokenize("zebra ç 42")) == "zebra ç 42"  # byte fallback


def test_llama2_prepends_bos(sp_model):
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    ids = tok.tokenize(TEXT)
    assert ids[0] == 1 and ids[1:] == sp.tokenize(TEXT)
    assert tok.detokenize(ids) == TEXT and tok.eod == 2


def test_sentencepiece_pickles(sp_model):
    import pickle

    tok = pickle.loads(pickle.dumps(build_tokenizer("SentencePieceTokenizer",
                                                    tokenizer_model=sp_model)))
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


def test_gpt2_bpe(bpe_files):
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(bpe_files / "vocab.json"),
                          merge_file=str(bpe_files / "merges.txt"))
    vocab = json.loads((bpe_files / "vocab.json").read_text())
    assert tok.vocab_size == len(vocab) and tok.eod == vocab["<|endoftext|>"]
    ids = tok.tokenize(TEXT)
    assert tok.detokenize(ids) == TEXT
    assert tok.detokenize(ids + [tok.eod]) == TEXT + "<|endoftext|>"


def test_huggingface_file_and_directory(bpe_files, tmp_path):
    for path in (bpe_files / "tokenizer.json", bpe_files):
        tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
        assert tok.detokenize(tok.tokenize(TEXT)) == TEXT
        assert tok.eod == json.loads((bpe_files / "vocab.json").read_text())["<|endoftext|>"]
    # tokenizer_config.json's eos_token wins over the guessed spellings.
    d = tmp_path / "repo"
    d.mkdir()
    shutil.copy(bpe_files / "tokenizer.json", d / "tokenizer.json")
    tok0 = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(d))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "!"}}))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(d))
    assert tok.eod == tok0.tokenize("!")[0] != tok0.eod


def test_null_tokenizer():
    """Megatron's NullTokenizer: --vocab-size ids in all, EOD = vocab_size - 1, or
    --null-tokenizer-eod-id; an EOD outside the vocabulary is refused."""
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.vocab_size == 100 and tok.eod == 99
    tok = build_tokenizer("NullTokenizer", vocab_size=100, null_eod_id=0)
    assert tok.vocab_size == 100 and tok.eod == 0
    for bad in (100, -1):
        with pytest.raises(DataError, match="--null-tokenizer-eod-id"):
            build_tokenizer("NullTokenizer", vocab_size=100, null_eod_id=bad)
    assert tok.tokenize("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"


@pytest.mark.parametrize("kind,kw,match", [
    ("SentencePieceTokenizer", {"tokenizer_model": "/nonexistent/t.model"}, "t.model"),
    ("SentencePieceTokenizer", {}, "--tokenizer-model"),
    ("HuggingFaceTokenizer", {"tokenizer_model": "/nonexistent/dir"}, "/nonexistent/dir"),
    ("GPT2BPETokenizer", {"vocab_file": "/nonexistent/v.json", "merge_file": "/x"}, "v.json"),
    ("NullTokenizer", {}, "--vocab-size"),
    ("WordPiece", {}, "unknown"),
])
def test_bad_files_are_data_errors(kind, kw, match):
    with pytest.raises(DataError, match=match):
        build_tokenizer(kind, **kw)


def test_corrupt_model_files(tmp_path, bpe_files):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match="bad.model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(bad))
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text("{")
    with pytest.raises(DataError, match="tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bad_json))
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({"a": 0}))
    with pytest.raises(DataError, match="endoftext"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab),
                        merge_file=str(bpe_files / "merges.txt"))
