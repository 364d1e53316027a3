"""tools/preprocess_data.py --split-sentences (--keep-newlines, --lang) against the nltk
calls Megatron-LM's tools/preprocess_data.py makes, written out here, and missing nltk
or punkt data as one line. The byte-identity against Megatron's own script run by the
megatron-core peer is test_identical_to_megatron_split_sentences (slow).

The reference (`_megatron_split_encode`) is Megatron's Encoder.initializer / split /
encode at d98e8a6 as a naive loop: `nltk.load("tokenizers/punkt/<lang>.pickle")`, for
--keep-newlines a PunktSentenceTokenizer over its parameters with Megatron's
CustomLanguageVars (its regex copied here), each 1,000,000-character piece split on its
own, every sentence tokenized alone, empty ones dropped, eod on the last one, written by
IndexedDatasetBuilder.add_document (the builder Megatron's .idx format is pinned against
in test_indexed_dataset.py / the data-interchange tests).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from megamoe.data import build_tokenizer
from megamoe.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")

# Megatron-LM tools/preprocess_data.py CustomLanguageVars._period_context_fmt, verbatim.
MEGATRON_PERIOD_CONTEXT = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        \s*                       #  <-- THIS is what I changed
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            (?P<next_tok>\S+)     #  <-- Normally you would have \s+ here
        ))"""


@pytest.fixture(scope="session")
def nltk_site():
    from tests.data.nltk_env import NltkUnavailable, nltk_site

    try:
        site = nltk_site()
    except NltkUnavailable as e:
        pytest.skip(f"nltk unavailable for the test: {e}")
    if site not in sys.path:
        sys.path.insert(0, site)
    return site


@pytest.fixture(scope="session")
def nltk_data(tmp_path_factory, nltk_site):
    """A private NLTK_DATA folder with punkt_tab/english trained on Shakespeare."""
    from tests.data.nltk_env import shakespeare_text, train_punkt_tab

    data = tmp_path_factory.mktemp("nltk_data")
    os.chmod(data, 0o700)  # nltk writes and trusts only private data folders
    train_punkt_tab(str(data), "\n".join(shakespeare_text()[:8]))
    return str(data)


def corpus_docs() -> list[dict]:
    """Shakespeare paragraphs as documents, plus the edge cases of a split: an empty
    text, whitespace only, abbreviations, blank lines between sentences."""
    from tests.data.nltk_env import shakespeare_text

    paragraphs = [p for t in shakespeare_text()[20:22] for p in t.split("\n\n") if p.strip()]
    texts = ["\n\n".join(paragraphs[i:i + 5]) for i in range(0, 150, 5)]
    texts += ["", "  \n\n ", "Mr. Smith met Dr. Watson at 5 p.m. on St. James St. Then "
              "they left.\n\nA new paragraph! Is it? Yes.\nEnd", "no sentence end here"]
    return [{"text": t, "title": t[:40].upper()} for t in texts]


def _env(nltk_site, nltk_data, home):
    return dict(os.environ, OMP_NUM_THREADS="1", NLTK_DATA=nltk_data, HOME=str(home),
                PYTHONPATH=os.pathsep.join([ROOT, nltk_site]))


def _run(args, env):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=env)


def _megatron_split_encode(docs, keys, tok, nltk_data, prefix, keep_newlines,
                           append_eod, lang="english"):
    """Megatron's Encoder (split, then encode) as a naive loop over `docs`."""
    import nltk
    from nltk.tokenize.punkt import PunktLanguageVars

    class CustomLanguageVars(PunktLanguageVars):
        _period_context_fmt = MEGATRON_PERIOD_CONTEXT

    nltk.data.path.insert(0, nltk_data)  # Megatron's `nltk:` branch searches this path
    try:
        splitter = nltk.load(os.path.join("tokenizers", "punkt", f"{lang}.pickle"))
    finally:
        nltk.data.path.remove(nltk_data)
    if keep_newlines:
        splitter = nltk.tokenize.punkt.PunktSentenceTokenizer(
            train_text=splitter._params, lang_vars=CustomLanguageVars())
    dtype = optimal_dtype(tok.vocab_size)
    for key in keys:
        with IndexedDatasetBuilder(f"{prefix}_{key}_sentence.bin", dtype) as builder:
            for doc in docs:
                text, max_len = doc[key], 1000000
                sentences = [s for i in range(0, len(text), max_len)
                             for s in splitter.tokenize(text[i:i + max_len])]
                doc_ids, sentence_lens = [], []
                for sentence in sentences:
                    ids = tok.tokenize(sentence)
                    if len(ids) > 0:
                        doc_ids.extend(ids)
                        sentence_lens.append(len(ids))
                if len(doc_ids) > 0 and append_eod:
                    doc_ids.append(tok.eod)
                    sentence_lens[-1] += 1
                builder.add_document(doc_ids, sentence_lens)
            builder.finalize(f"{prefix}_{key}_sentence.idx")


def _same_files(a: str, b: str) -> None:
    for ext in (".bin", ".idx"):
        with open(a + ext, "rb") as fa, open(b + ext, "rb") as fb:
            assert fa.read() == fb.read(), f"{a}{ext} != {b}{ext}"


def test_split_sentences_is_megatrons_nltk_split(tmp_path, sp_model, nltk_site, nltk_data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = corpus_docs()
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    pq.write_table(pa.table({"text": [d["text"] for d in docs]}), tmp_path / "in.parquet",
                   row_group_size=9)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    env = _env(nltk_site, nltk_data, tmp_path)
    common = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
              "--split-sentences", "--chunk-size", "7"]
    # run 1 reads the Parquet copy; run 2: Megatron's --partitions 2 sends document i to
    # partition i % 2 and merges partition 0 then 1 into {prefix}_{key}_sentence
    runs = [(False, True, ["text"], ["--workers", "1", "--input", tmp_path / "in.parquet"]),
            (True, False, ["text", "title"], ["--workers", "2", "--partitions", "2",
                                              "--lang", "english", "--input", src])]
    n_sentences = []
    for keep_newlines, eod, keys, extra in runs:
        name = f"nl{int(keep_newlines)}"
        flags = (["--keep-newlines"] if keep_newlines else []) + (
            ["--append-eod"] if eod else [])
        p = _run([*common, *flags, *extra, "--json-keys", *keys,
                  "--output-prefix", tmp_path / f"ours_{name}"], env)
        assert p.returncode == 0, p.stderr
        order = docs[0::2] + docs[1::2] if "--partitions" in extra else docs
        _megatron_split_encode(order, keys, tok, nltk_data, str(tmp_path / f"ref_{name}"),
                               keep_newlines, eod)
        for key in keys:
            _same_files(str(tmp_path / f"ours_{name}_{key}_sentence"),
                        str(tmp_path / f"ref_{name}_{key}_sentence"))
        from megamoe.data import IndexedDataset

        ds = IndexedDataset(str(tmp_path / f"ours_{name}_text_sentence"))
        assert ds.num_documents == len(docs)
        n_sentences.append(len(ds))
    # the split is real (several sentences per document) and --keep-newlines changes it
    assert n_sentences[0] > 3 * len(docs), n_sentences
    ours = [open(tmp_path / f"{w}_text_sentence.bin", "rb").read() for w in
            ("ours_nl0", "ours_nl1")]
    assert ours[0] != ours[1]


def test_split_text_splits_each_million_characters_alone():
    """Megatron's Encoder.split tokenizes text[i:i + 1000000] one piece at a time."""
    from megamoe.data.sentence_split import split_text

    class Recorder:
        pieces: list = []

        def tokenize(self, text):
            self.pieces.append(len(text))
            return [text[:3], text[3:]] if text else []

    out = split_text(Recorder(), "x" * 2_500_000)
    assert Recorder.pieces == [1_000_000, 1_000_000, 500_000] and len(out) == 6
    assert split_text(Recorder(), "") == []


def test_missing_nltk_or_punkt_data_is_one_line(tmp_path, sp_model, nltk_site):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "One. Two."}) + "\n")
    out = tmp_path / "out"
    args = ["--input", src, "--output-prefix", out, "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--workers", "1",
            "--split-sentences"]
    empty = tmp_path / "empty_nltk_data"
    empty.mkdir(mode=0o700)
    env = _env(nltk_site, str(empty), tmp_path)
    p = _run(args, env)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1, p.stderr
    assert "punkt_tab" in err[0] and "python -m nltk.downloader punkt_tab" in err[0], err
    # nltk not importable at all (blocked in sys.modules, as if not installed)
    block = ("import runpy, sys; sys.modules['nltk'] = None; sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", block, TOOL, *map(str, args)],
                       capture_output=True, text=True, timeout=120, env=env)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1 and "needs nltk" in err[0], p.stderr
    # a list of sentences cannot be split again (Megatron's split fails on it)
    src.write_text(json.dumps({"text": "One. Two."}) + "\n" + json.dumps({"text": ["a"]}))
    nltk_data = tmp_path / "nltk_data"
    nltk_data.mkdir(mode=0o700)
    shutil.copytree(os.path.join(_trained(nltk_site, tmp_path), "tokenizers"),
                    nltk_data / "tokenizers")
    p = _run(args, _env(nltk_site, str(nltk_data), tmp_path))
    err = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1 and "line 2" in err[0], p.stderr
    assert not list(tmp_path.glob("out*")), "nothing may be written"
    # --lang must name a model folder: a bad flag, exit 2
    p = _run([*args, "--lang", "english/../german"], env)
    assert p.returncode == 2 and "--lang" in p.stderr.strip().splitlines()[-1]


def _trained(nltk_site, tmp_path) -> str:
    """A small punkt_tab/english (a few paragraphs are enough for a model that loads)."""
    from tests.data.nltk_env import train_punkt_tab

    data = tmp_path / "small_nltk_data"
    data.mkdir(mode=0o700)
    train_punkt_tab(str(data), "One sentence. Another one here. Mr. Smith left. " * 20)
    return str(data)


@pytest.mark.slow
def test_identical_to_megatron_split_sentences(tmp_path, nltk_site):
    """Megatron-LM's own tools/preprocess_data.py (pinned commit, megatron-core peer venv,
    nltk 3.10.4 on its PYTHONPATH) against megamoe's, with and without --keep-newlines,
    on the corpus plus one document over 1,000,000 characters: identical .bin/.idx.

    The punkt_tab data sits in $HOME/nltk_data with NLTK_DATA unset: Megatron's NLTK_DATA
    branch loads `file:$NLTK_DATA/tokenizers/punkt/<lang>.pickle`, which nltk >= 3.9 does
    not redirect to punkt_tab (its workers fail to start and the pool restarts them
    forever). With --partitions 1 Megatron's first run only writes `<input>_ss.jsonl`
    (its main loop `continue`s after the split); the second run encodes that file.
    """
    from tests.data.nltk_env import shakespeare_text, train_punkt_tab
    from tests.data.test_preprocess_vs_megatron import _peer_or_skip
    from tools import bench_preprocess

    py = _peer_or_skip()
    home = tmp_path / "home"
    (home / "nltk_data").mkdir(parents=True, mode=0o700)
    train_punkt_tab(str(home / "nltk_data"), "\n".join(shakespeare_text()[:8]))
    docs = corpus_docs() + [{"text": "\n".join(shakespeare_text()[30:130])[:1_200_000]}]
    assert len(docs[-1]["text"]) > 1_000_000
    lines = "".join(json.dumps({"text": d["text"]}) + "\n" for d in docs)
    (tmp_path / "corpus.jsonl").write_text(lines)
    tok = bench_preprocess.train_tokenizer(str(tmp_path / "corpus.jsonl"), str(tmp_path / "tok"))
    mlm = bench_preprocess.megatron_checkout(bench_preprocess.parse_args([]).git_dir,
                                             bench_preprocess.COMMIT, str(tmp_path / "mlm"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NLTK_DATA")}
    env.update(HOME=str(home), OMP_NUM_THREADS="1", PYTHONPATH=nltk_site)
    ours_env = dict(env, PYTHONPATH=os.pathsep.join([ROOT, nltk_site]))
    for flags in ([], ["--keep-newlines"]):
        name = "nl" if flags else "plain"
        src = tmp_path / f"{name}.jsonl"
        src.write_text(lines)
        common = ["--input", str(src), "--tokenizer-type", "HuggingFaceTokenizer",
                  "--tokenizer-model", tok, "--append-eod", "--workers", "2",
                  "--split-sentences", *flags]
        megatron = [py, os.path.join(mlm, "shim.py"), os.path.join(mlm, "tools",
                    "preprocess_data.py"), *common, "--output-prefix", str(tmp_path / name)]
        bench_preprocess.timed(megatron, env)  # pass 1: the split only
        assert (tmp_path / f"{name}_ss.jsonl").exists()
        assert not (tmp_path / f"{name}_text_sentence.bin").exists()
        bench_preprocess.timed(megatron, env)  # pass 2: encodes <input>_ss.jsonl
        bench_preprocess.timed([sys.executable, TOOL, *common, "--output-prefix",
                                str(tmp_path / f"ours_{name}")], ours_env)
        _same_files(str(tmp_path / f"{name}_text_sentence"),
                    str(tmp_path / f"ours_{name}_text_sentence"))


def test_worker_without_punkt_data_reports_instead_of_raising(nltk_site):
    """A Pool initializer that raises is restarted without end (Megatron's run hangs so):
    a worker whose splitter cannot load answers its first chunk with the one-line error."""
    from megamoe.data import preprocess_encode as enc

    try:
        enc.init_worker(lambda: None, enc.EncodeConfig(("text",), False, "uint16",
                                                       True, "no_such_language"))
        result = enc.encode_chunk(("json", 1, ['{"text": "One. Two."}']))
    finally:
        enc._STATE.clear()
    assert result.n_docs == 0 and "punkt_tab data for --lang no_such_language" in result.error
