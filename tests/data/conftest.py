"""Tiny tokenizer files built once per session (sentencepiece, byte-level BPE)."""

from __future__ import annotations

import json

import pytest

CORPUS = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles",
    "And by opposing end them. To die: to sleep;\nNo more; and by a sleep to say we end",
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;",
] * 8


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(CORPUS)))
    return path


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory, corpus_jsonl):
    """A 320-piece sentencepiece BPE model trained by tools/train_tokenizer.py."""
    from tools.train_tokenizer import main

    prefix = tmp_path_factory.mktemp("sp") / "tok"
    assert main(["--input", str(corpus_jsonl), "--vocab-size", "320",
                 "--output-prefix", str(prefix), "--threads", "1"]) == 0
    return str(prefix) + ".model"


@pytest.fixture(scope="session")
def bpe_files(tmp_path_factory):
    """GPT-2 style vocab.json + merges.txt (+ tokenizer.json) from a tiny byte-level BPE."""
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("bpe")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(str(d))
    tok.save(str(d / "tokenizer.json"))
    return d
