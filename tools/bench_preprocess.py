"""megamoe's tools/preprocess_data.py against Megatron-LM's, same input and tokenizer:
byte-identical outputs and the tokens/s ratio, printed as JSON.

    python tools/bench_preprocess.py --corpus-mb 10 --workers 2 --repeats 3

Megatron's script runs from a `git archive` of tools/ and megatron/ at the pinned commit
with the megatron-core peer venv's Python (tests/tools/megatron_peer/mcore_venv.py; it
needs transformers and tokenizers installed in it). That commit's megatron/training
imports `typing.override` (Python 3.12) while the peer venv is Python 3.11: the run goes
through a three-line shim that defines it as the identity decorator, which is what it is
in 3.12. Both tools use `--tokenizer-type HuggingFaceTokenizer` on one local tokenizer.json
folder (a byte-level BPE trained here on the corpus unless --tokenizer is given).

The corpus is the bundled Shakespeare split into paragraph-sized documents, repeated to
--corpus-mb; a Parquet copy of it must give the same bytes. Runs alternate between the
two tools (drift on a shared machine hits both); each figure is the median of --repeats
wall times of the whole command (`ratio`, start-up included: Megatron's imports of
megatron.training take tens of seconds here). `steady_ratio` compares the processing rate
each tool reports itself in its last `Processed N documents (x docs/s, ...)` line, timed
from the start of processing, so start-up is left out. `peak_rss_mb` is megamoe's
largest process at 1x and 10x of --memory-mb of input: memory must not grow with input.
"""

from __future__ import annotations

import argparse
import glob
import json
import lzma
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # Megatron-LM main, 2026-08-22
SHIM = ("import runpy, sys, typing\n"
        "typing.override = getattr(typing, 'override', lambda f: f)\n"
        "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--git-dir", default="/work/.mirror/NVIDIA+Megatron-LM/repo")
    p.add_argument("--commit", default=COMMIT)
    p.add_argument("--peer-python", default=None, help="default: the cached mcore venv")
    p.add_argument("--tokenizer", default=None, help="a folder with tokenizer.json")
    p.add_argument("--corpus-mb", type=float, default=10.0)
    p.add_argument("--memory-mb", type=float, default=2.0, help="0 skips the memory runs")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None, help="keep files here (default: a temp dir)")
    args = p.parse_args(argv)
    if args.corpus_mb <= 0 or args.repeats < 1 or args.workers < 1 or args.memory_mb < 0:
        p.error("--corpus-mb > 0, --memory-mb >= 0, --repeats >= 1, --workers >= 1")
    return args


def peer_python(given) -> str:
    if given:
        return given
    found = sorted(glob.glob(os.path.expanduser("~/.cache/megamoe/mcore-venv/*/bin/python")))
    if not found:
        raise RuntimeError("no megatron-core peer venv (build it with "
                           "tests/tools/megatron_peer/mcore_venv.py or pass --peer-python)")
    return found[-1]


def megatron_checkout(git_dir: str, commit: str, dest: str) -> str:
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.run(["git", "--git-dir", git_dir, "archive", commit, "tools",
                              "megatron"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    with open(os.path.join(dest, "shim.py"), "w") as f:
        f.write(SHIM)
    return dest


def make_corpus(path: str, megabytes: float) -> int:
    """Paragraph-sized documents from the bundled Shakespeare, repeated to `megabytes`."""
    src = os.path.join(ROOT, "data", "shakespeare", "shakespeare.jsonl.xz")
    with lzma.open(src, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    paragraphs = [p for t in texts for p in t.split("\n\n") if p.strip()]
    docs = ["\n\n".join(paragraphs[i:i + 4]) for i in range(0, len(paragraphs), 4)]
    target, size, n = int(megabytes * 2**20), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            line = json.dumps({"text": docs[n % len(docs)], "id": n}) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
            n += 1
    return n


def to_parquet(src: str, dest: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(src, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    pq.write_table(pa.table({"text": texts}), dest, row_group_size=4096)


def train_tokenizer(corpus: str, dest: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(20000), f)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(dest, exist_ok=True)
    tok.save(os.path.join(dest, "tokenizer.json"))
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"},
                  f)
    return dest


_RATE = re.compile(rb"Processed (\d+) documents \(([\d.]+) docs/s")


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, the tool's own last reported docs/s) of one command (which must
    succeed). The reported rate is timed from the start of processing, after imports."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (err or out).decode(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{cmd[1]} failed ({proc.returncode}): {' | '.join(tail)}")
    rates = _RATE.findall(err)
    return wall, float(rates[-1][1]) if rates else float("nan")


def commands(args, mlm: str, py: str, tok: str, workers: int):
    common = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok,
              "--append-eod", "--workers", str(workers)]

    def megatron(src, prefix):
        return [py, os.path.join(mlm, "shim.py"), os.path.join(mlm, "tools",
                "preprocess_data.py"), "--input", src, "--output-prefix", prefix, *common]

    def megamoe(src, prefix):
        return [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                "--input", src, "--output-prefix", prefix, *common]
    return megatron, megamoe


def same_files(a: str, b: str) -> bool:
    suffixes = ("_text_document.bin", "_text_document.idx")
    return all(open(a + s, "rb").read() == open(b + s, "rb").read() for s in suffixes)


def token_count(prefix: str) -> int:
    sys.path.insert(0, ROOT)
    from megamoe.data import IndexedDataset

    return IndexedDataset(prefix + "_text_document").num_tokens


def bench(args, work: str) -> dict:
    mlm = megatron_checkout(args.git_dir, args.commit, os.path.join(work, "mlm"))
    py = peer_python(args.peer_python)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=mlm,
               TOKENIZERS_PARALLELISM="true")
    corpus = os.path.join(work, "corpus.jsonl")
    n_docs = make_corpus(corpus, args.corpus_mb)
    tok = args.tokenizer or train_tokenizer(corpus, os.path.join(work, "tok"))
    megatron, megamoe = commands(args, mlm, py, tok, args.workers)
    walls, rates = {"megatron": [], "megamoe": []}, {"megatron": [], "megamoe": []}
    for r in range(args.repeats):  # alternate, so load drift hits both
        for name, cmd, out in (("megatron", megatron, "m"), ("megamoe", megamoe, "o")):
            wall, rate = timed(cmd(corpus, os.path.join(work, f"{out}{r}")), env)
            walls[name].append(wall)
            rates[name].append(rate)
    parquet = os.path.join(work, "corpus.parquet")
    to_parquet(corpus, parquet)
    timed(megamoe(parquet, os.path.join(work, "pq")), env)
    tokens = token_count(os.path.join(work, "m0"))
    med = {k: statistics.median(v) for k, v in walls.items()}
    med_rate = {k: statistics.median(v) for k, v in rates.items()}
    tokens_per_doc = tokens / n_docs
    result = {
        "megatron_lm_commit": args.commit, "workers": args.workers, "documents": n_docs,
        "input_mb": round(os.path.getsize(corpus) / 2**20, 2), "tokens": tokens,
        "wall_s": {k: [round(x, 2) for x in v] for k, v in walls.items()},
        "tokens_per_s": {k: round(tokens / v) for k, v in med.items()},
        "ratio": round(med["megatron"] / med["megamoe"], 2),
        "reported_docs_per_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "steady_tokens_per_s": {k: round(v * tokens_per_doc) for k, v in med_rate.items()},
        "steady_ratio": round(med_rate["megamoe"] / med_rate["megatron"], 2),
        "identical_jsonl": all(same_files(os.path.join(work, "m0"), os.path.join(work, f"o{r}"))
                               for r in range(args.repeats)),
        "identical_parquet": same_files(os.path.join(work, "m0"), os.path.join(work, "pq")),
    }
    if args.memory_mb > 0:
        result["peak_rss_mb"] = memory_runs(args, work, megamoe, env)
    return result


def memory_runs(args, work: str, megamoe, env: dict) -> dict:
    """megamoe's peak RSS at 1x and 10x of --memory-mb (a fresh process tree each, so
    RUSAGE_CHILDREN is read in a child Python that runs only that command)."""
    out = {}
    for scale in (1, 10):
        src = os.path.join(work, f"mem{scale}.jsonl")
        make_corpus(src, args.memory_mb * scale)
        cmd = megamoe(src, os.path.join(work, f"mem{scale}"))
        probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
                 "capture_output=True); print(resource.getrusage("
                 "resource.RUSAGE_CHILDREN).ru_maxrss)")
        done = subprocess.run([sys.executable, "-c", probe, *cmd], env=env, check=True,
                              capture_output=True, text=True)
        out[f"{args.memory_mb * scale:g}MB"] = round(int(done.stdout.strip()) / 1024, 1)
        os.remove(src)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        result = bench(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory() as work:
            result = bench(args, work)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
