"""tools/preprocess_data.py: Megatron's option set, every input format giving the same
bytes, partitions, bad input, and tools/merge_datasets.py.

The reference for token content is a naive loop over the tokenizer (one document at a
time); the byte-identity against Megatron-LM's own script is the slow test in
test_preprocess_vs_megatron.py.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
import os

import numpy as np
import pytest

from megamoe.data import IndexedDataset, build_tokenizer
from tools import merge_datasets, preprocess_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "megatron_preprocess_options.json")

# Megatron option -> the test that shows megamoe's meaning is Megatron's.
BUILT = {
    "--input": "test_every_format_gives_identical_bytes",
    "--json-keys": "test_every_format_gives_identical_bytes",
    "--output-prefix": "test_every_format_gives_identical_bytes",
    "--append-eod": "test_every_format_gives_identical_bytes",
    "--tokenizer-type": "test_every_format_gives_identical_bytes",
    "--tokenizer-model": "test_every_format_gives_identical_bytes",
    "--workers": "test_every_format_gives_identical_bytes",
    "--vocab-size": "test_partitions_round_robin_and_sequential",
    "--null-tokenizer-eod-id": "test_partitions_round_robin_and_sequential",
    "--partitions": "test_partitions_round_robin_and_sequential",
    "--keep-sequential-samples": "test_partitions_round_robin_and_sequential",
    "--find-optimal-num-workers": "test_find_optimal_num_workers_publishes_nothing",
    "--log-interval": "test_find_optimal_num_workers_publishes_nothing",
    "--workers-to-check": "test_find_optimal_num_workers_publishes_nothing",
    "--max-documents": "test_find_optimal_num_workers_publishes_nothing",
    "--vocab-file": "tests/data/test_tokenizers.py (GPT2BPETokenizer)",
    "--merge-file": "tests/data/test_tokenizers.py (GPT2BPETokenizer)",
    "--trust-remote-code": "tests/data/test_remote_tokenizer.py",
    "--split-sentences": "tests/data/test_preprocess_split_sentences.py",
    "--keep-newlines": "tests/data/test_preprocess_split_sentences.py",
    "--lang": "tests/data/test_preprocess_split_sentences.py",
}


def _opts_of(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_option_set_matches_pinned_megatron_and_each_is_classified(capsys):
    from megamoe.cli.preprocess_args import NOOP, REFUSED, build_parser, parse_args

    with open(FIXTURE) as f:
        pinned = set(json.load(f)["options"])
    ours = _opts_of(build_parser()) - {"--help", "--chunk-size"}  # --chunk-size: megamoe's
    assert ours == pinned, (sorted(pinned - ours), sorted(ours - pinned))
    assert set(BUILT) | set(NOOP) | set(REFUSED) == pinned
    assert not (set(BUILT) & set(NOOP)) and not (set(BUILT) & set(REFUSED))
    base = ["--input", "x", "--output-prefix", "y", "--tokenizer-type", "NullTokenizer",
            "--workers", "1"]
    values = {"--tiktoken-pattern": ["v1"], "--tiktoken-num-special-tokens": ["5"],
              "--tokenizer-special-tokens": ["<a>"], "--tokenizer-metadata": ["m.json"],
              "--chat-template": ["t"]}
    for flag in REFUSED:
        with pytest.raises(SystemExit) as e:
            parse_args(base + [flag, *values.get(flag, [])])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "not supported yet: " in err[0]
        assert flag in err[0], err
    for flag in ("--workers", "--partitions", "--log-interval", "--max-documents",
                 "--workers-to-check", "--chunk-size", "--vocab-size",
                 "--null-tokenizer-eod-id"):
        eod = flag == "--null-tokenizer-eod-id"
        for value in (["-1", "7"] if eod else ["0"]):
            with pytest.raises(SystemExit) as e:
                parse_args(base + [flag, value] + (["--vocab-size", "7"] if eod else []))
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and flag in err[-1], (flag, err)
    for lang in ("", "english/../german", "en glish"):  # one punkt_tab folder name
        with pytest.raises(SystemExit) as e:
            parse_args(base + ["--split-sentences", "--lang", lang])
        assert e.value.code == 2 and "--lang" in capsys.readouterr().err
    assert parse_args(base + ["--lang", "german-1_x"]).lang == "german-1_x"
    with pytest.raises(SystemExit) as e:
        parse_args(base[:-1] + ["3", "--partitions", "2"])
    assert e.value.code == 2 and "--partitions" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_args(base[:5] + ["BertWordPieceCase", "--workers", "1"])
    assert e.value.code == 2 and "not supported yet: --tokenizer-type" in (
        capsys.readouterr().err)


def _docs(n=120):
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "\n", "é"]
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(i % 17))
            for i in range(n)]


def _write(path, texts, key="text"):
    name = str(path)
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({key: texts, "n": list(range(len(texts)))}), name,
                       row_group_size=37)
        return
    body = "".join(json.dumps({key: t, "n": i}) + "\n" for i, t in enumerate(texts)).encode()
    if name.endswith(".gz"):
        body = gzip.compress(body)
    elif name.endswith(".xz"):
        body = lzma.compress(body)
    elif name.endswith(".zst"):
        import zstandard

        # two frames: readers must continue across frame boundaries
        half = len(body) // 2
        c = zstandard.ZstdCompressor()
        body = c.compress(body[:half]) + c.compress(body[half:])
    path.write_bytes(body)


def _main(*args) -> int:
    return preprocess_data.main([str(a) for a in args])


def test_every_format_gives_identical_bytes(tmp_path, bpe_files):
    texts = _docs()
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bpe_files))
    expected = [tok.tokenize(t) + [tok.eod] if tok.tokenize(t) else [] for t in texts]
    outputs = {}
    for i, suffix in enumerate([".jsonl", ".jsonl.gz", ".jsonl.xz", ".jsonl.zst",
                                ".parquet"]):
        src = tmp_path / f"in{suffix}"
        _write(src, texts)
        prefix = tmp_path / f"out{i}"
        assert _main("--input", src, "--output-prefix", prefix, "--tokenizer-type",
                     "HuggingFaceTokenizer", "--tokenizer-model", bpe_files, "--append-eod",
                     "--workers", 2 if i == 0 else 1, "--chunk-size", 16) == 0
        ds = IndexedDataset(f"{prefix}_text_document")
        assert ds.num_documents == len(texts) and ds.dtype == np.uint16
        got = [ds.get(int(ds.document_indices[d])).tolist()
               if ds.document_indices[d + 1] > ds.document_indices[d] else []
               for d in range(len(texts))]
        assert got == expected, suffix
        outputs[suffix] = tuple((tmp_path / f"out{i}_text_document{e}").read_bytes()
                                for e in (".bin", ".idx"))
    assert len(set(outputs.values())) == 1


def test_sentence_lists_are_sequences(tmp_path):
    """A list value is a document of sentences (Megatron's encode): one sequence each,
    empty ones dropped, eod on the last."""
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps({"text": ["1 2", "", "3"]}) + "\n"
                   + json.dumps({"text": "4 5 6"}) + "\n")
    assert _main("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type",
                 "NullTokenizer", "--vocab-size", 10, "--append-eod", "--workers", 1) == 0
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert ds.sequence_lengths.tolist() == [2, 2, 4]
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert [ds[i].tolist() for i in range(3)] == [[1, 2], [3, 9], [4, 5, 6, 9]]


def _null(*extra):
    return ("--tokenizer-type", "NullTokenizer", "--vocab-size", 1000, *extra)


def test_partitions_round_robin_and_sequential(tmp_path):
    """Megatron's --partitions: input glob, partition p gets documents p, p+P, ... (or
    consecutive blocks with --keep-sequential-samples); partitions are merged in order."""
    a, b = tmp_path / "in_a.jsonl", tmp_path / "in_b.jsonl"
    _write(a, [str(i) for i in range(5)])
    _write(b, [str(i) for i in range(5, 11)])
    glob_ = tmp_path / "in_*.jsonl"
    for sequential, order in ((False, [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8]),
                              (True, list(range(11)))):
        out = tmp_path / ("seq" if sequential else "rr")
        out.mkdir()
        flags = ["--keep-sequential-samples"] if sequential else []
        assert _main("--input", glob_, "--output-prefix", out / "o", "--partitions", 3,
                     "--workers", 3, "--append-eod", "--null-tokenizer-eod-id", 999,
                     *_null(), *flags) == 0
        ds = IndexedDataset(str(out / "o_text_document"))
        assert [ds[i].tolist() for i in range(len(ds))] == [[i, 999] for i in order]
        parts = [IndexedDataset(str(out / f"o_{p}_text_document")) for p in range(3)]
        assert sum(len(p) for p in parts) == 11
        # merge_datasets.py joins the same partitions to the same bytes
        os.remove(out / "o_text_document.bin")
        os.remove(out / "o_text_document.idx")
        assert merge_datasets.main(["--input", str(out), "--output-prefix",
                                    str(tmp_path / f"m{int(sequential)}")]) == 0
        merged = IndexedDataset(str(tmp_path / f"m{int(sequential)}"))
        assert [merged[i].tolist() for i in range(11)] == [[i, 999] for i in order]


def test_find_optimal_num_workers_publishes_nothing(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    _write(src, [str(i) for i in range(50)])
    assert _main("--input", src, "--output-prefix", tmp_path / "o", "--workers", 1,
                 "--find-optimal-num-workers", "--workers-to-check", 1, 2,
                 "--max-documents", 20, "--log-interval", 10, "--chunk-size", 5, *_null()) == 0
    out = capsys.readouterr()
    assert "The most optimal num of workers is" in out.out
    assert out.err.count("Processed 10 documents") == 2  # --log-interval lines, per run
    assert "Processed 30 documents" not in out.err  # --max-documents 20
    assert " 1 workers -> " in out.out and " 2 workers -> " in out.out  # --workers-to-check
    assert os.listdir(tmp_path) == ["in.jsonl"]


def _one_line(capsys, code, rc, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code and len(err) == 1, err
    for n in needles:
        assert n in err[0], err[0]


def _cut(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def test_bad_inputs_name_the_file_and_publish_nothing(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.jsonl"
    _write(good, [str(i) for i in range(300)])
    assert _main("--input", good, "--output-prefix", tmp_path / "o", "--workers", 1,
                 *_null()) == 0
    capsys.readouterr()
    outs = ("o_text_document.bin", "o_text_document.idx")
    before = {f: (tmp_path / f).read_bytes() for f in outs}

    def bad(src, *needles):
        rc = _main("--input", src, "--output-prefix", tmp_path / "o", "--workers", 2,
                   "--chunk-size", 50, "--log-interval", 10**6, *_null())
        _one_line(capsys, 1, rc, str(src), *needles)

    for suffix in (".jsonl.gz", ".jsonl.xz", ".jsonl.zst"):
        src = tmp_path / f"cut{suffix}"
        _write(src, [" ".join(str(j) for j in range(i % 50)) for i in range(3000)])
        _cut(src)
        bad(src, "unreadable input")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1" + os.urandom(500))
    bad(junk, "malformed Parquet")
    pq_ok = tmp_path / "ok.parquet"
    _write(pq_ok, [str(i) for i in range(100)])
    data = pq_ok.read_bytes()
    cut_pq = tmp_path / "cut.parquet"
    cut_pq.write_bytes(data[: len(data) // 2])
    bad(cut_pq, "malformed Parquet")
    rc = _main("--input", pq_ok, "--json-keys", "body", "--output-prefix", tmp_path / "o",
               "--workers", 1, *_null())
    _one_line(capsys, 1, rc, "ok.parquet", "no column 'body'")
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["1"] * 70 + [None] + ["2"]}), nulls, row_group_size=30)
    bad(nulls, "row 70", "null")
    after = {f: (tmp_path / f).read_bytes() for f in outs}
    assert after == before
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_failing_partition_publishes_no_partition(tmp_path, capsys):
    _write(tmp_path / "in_0.jsonl", [str(i) for i in range(40)])
    (tmp_path / "in_1.jsonl").write_text('{"text": "1"}\n{"text": 7}\n')
    rc = _main("--input", tmp_path / "in_*.jsonl", "--output-prefix", tmp_path / "o",
               "--partitions", 2, "--workers", 2, *_null())
    _one_line(capsys, 1, rc, "in_1.jsonl: line 2", "'text'")
    assert sorted(os.listdir(tmp_path)) == ["in_0.jsonl", "in_1.jsonl"]


def test_merge_datasets_bad_input(tmp_path, capsys):
    d = tmp_path / "parts"
    d.mkdir()
    (d / "a.bin").write_bytes(b"")
    _one_line(capsys, 1, merge_datasets.main(["--input", str(d), "--output-prefix",
                                              str(tmp_path / "m")]), "a.idx")
    with pytest.raises(SystemExit) as e:
        merge_datasets.main(["--input", str(d), "--output-prefix", str(tmp_path / "m"),
                             "--multimodal"])
    assert e.value.code == 2
    assert "not supported yet: --multimodal" in capsys.readouterr().err
    (d / "a.idx").write_bytes(b"MMIDIDX\x00\x00" + io.BytesIO(b"x").read())
    _one_line(capsys, 1, merge_datasets.main(["--input", str(d), "--output-prefix",
                                              str(tmp_path / "m")]), "a.idx", "corrupt")
    assert not (tmp_path / "m.bin").exists()
