"""megamoe/data/jsonl.py (tools/train_tokenizer.py's reader) reads what
tools/preprocess_data.py reads, through the same opener: plain, .gz, .xz and .zst (over
frame boundaries), and a file cut short is one line naming it."""

from __future__ import annotations

import gzip
import json
import lzma

import pytest

from megamoe.data import DataError
from megamoe.data.jsonl import read_lines


def _body() -> bytes:
    docs = [{"text": f"line {i} caf\u00e9 \u2603 " + "x" * (i % 97)} for i in range(2000)]
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")


def _compress(body: bytes, suffix: str) -> bytes:
    if suffix == ".gz":
        return gzip.compress(body)
    if suffix == ".xz":
        return lzma.compress(body)
    if suffix == ".zst":
        import zstandard

        half = len(body) // 2  # two frames: the reader must go on past the first
        c = zstandard.ZstdCompressor()
        return c.compress(body[:half]) + c.compress(body[half:])
    return body


@pytest.mark.parametrize("suffix", ["", ".gz", ".xz", ".zst"])
def test_every_compression_reads_the_same_numbered_lines(tmp_path, suffix):
    body = _body()
    path = tmp_path / f"corpus.jsonl{suffix}"
    path.write_bytes(_compress(body, suffix))
    expected = list(enumerate(body.decode("utf-8").splitlines(keepends=True), start=1))
    assert list(read_lines(str(path))) == expected


def test_truncated_zst_is_one_line_naming_the_file(tmp_path, capsys):
    from tools.train_tokenizer import main

    path = tmp_path / "cut.jsonl.zst"
    data = _compress(_body(), ".zst")
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(DataError, match=r"cut\.jsonl\.zst: unreadable input"):
        list(read_lines(str(path)))
    prefix = tmp_path / "tok"
    rc = main(["--input", str(path), "--vocab-size", "64", "--output-prefix", str(prefix),
               "--threads", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("train_tokenizer.py: error: ") and str(path) in err[0], err[0]
    assert not list(tmp_path.glob("tok*"))  # nothing published
