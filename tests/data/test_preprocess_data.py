"""tools/preprocess_data.py end to end: ordered multi-worker output, bad input."""

from __future__ import annotations

import gzip
import json
import lzma
import os
import subprocess
import sys

import numpy as np
import pytest

from megamoe.data import IndexedDataset, build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env)


def _docs(n=150):
    return [{"id": i, "text": f"{i} " + " ".join(str((i * 7 + t) % 90) for t in range(i % 13)),
             "title": f"{i % 5} {i % 3}"} for i in range(n)]


def test_two_workers_keep_order_and_append_eod(tmp_path, sp_model):
    from tests.data.conftest import CORPUS

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    p = _run("--input", src, "--output-prefix", tmp_path / "out", "--tokenizer-type",
             "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--append-eod",
             "--workers", 2, "--chunk-size", 3)
    assert p.returncode == 0, p.stderr
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    assert ds.dtype == np.uint16 and len(ds) == ds.num_documents == len(CORPUS)
    for i, text in enumerate(CORPUS):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]


@pytest.mark.parametrize("opener,suffix", [(gzip.open, ".jsonl.gz"), (lzma.open, ".jsonl.xz")])
def test_compressed_input_and_several_keys(tmp_path, opener, suffix):
    docs = _docs()
    src = tmp_path / f"in{suffix}"
    with opener(src, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
        f.write(json.dumps({"text": "", "title": ""}) + "\n")  # empty document
    p = _run("--input", src, "--json-keys", "text", "title", "--output-prefix", tmp_path / "o",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", 100, "--workers", 2,
             "--append-eod")
    assert p.returncode == 0, p.stderr
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / f"o_{key}_document"))
        assert ds.num_documents == len(docs) + 1
        assert ds.document_indices[-1] == ds.document_indices[-2]  # empty doc: no sequence
        for i, d in enumerate(docs):
            assert ds[i].tolist() == [int(x) for x in d[key].split()] + [99]  # EOD: vocab_size - 1


def _expect_one_line_error(p, *needles):
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


NULL = ("--tokenizer-type", "NullTokenizer", "--vocab-size", 100, "--workers", 2)


def test_bad_inputs_are_one_line_and_keep_old_outputs(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(d) + "\n" for d in _docs(20)))
    assert _run("--input", good, "--output-prefix", tmp_path / "o", *NULL).returncode == 0
    before = {f: (tmp_path / f).read_bytes() for f in ("o_text_document.bin",
                                                         "o_text_document.idx")}

    _expect_one_line_error(_run("--input", tmp_path / "missing.jsonl", "--output-prefix",
                                tmp_path / "o", *NULL), "missing.jsonl")
    lines = [json.dumps(d) for d in _docs(60)]
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text("\n".join(lines[:45] + ['{"text": "1 2'] + lines[45:]) + "\n")
    _expect_one_line_error(_run("--input", bad_json, "--output-prefix", tmp_path / "o", *NULL),
                           "bad.jsonl: line 46", "invalid JSON")
    no_key = tmp_path / "nokey.jsonl"
    no_key.write_text("\n".join(lines[:3] + ['{"body": "1 2"}']) + "\n")
    _expect_one_line_error(_run("--input", no_key, "--output-prefix", tmp_path / "o", *NULL),
                           "nokey.jsonl: line 4", "'text' missing")
    _expect_one_line_error(_run("--input", good, "--output-prefix", tmp_path / "o",
                                "--tokenizer-type", "SentencePieceTokenizer",
                                "--tokenizer-model", tmp_path / "none.model", "--workers", 1),
                           "none.model")

    after = {f: (tmp_path / f).read_bytes() for f in before}
    assert after == before
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
