#!/usr/bin/env python
"""Benchmark: time and peak memory of building the dataset indices megamoe caches.

Cases (each in a fresh child process, so its peak RSS is its own):
- blend: Megatron's greedy blending index over K weighted datasets (random weights from
  --seed) for N samples, in memory, or with --stream DIR written into .npy files the way
  the cache does (memory one chunk, whatever N).
- gpt: the document, sample and shuffle indices of one synthetic dataset of D documents
  (random lengths 1..2*--mean-doc-tokens, one sequence each, like a GPT corpus), cut
  into --seq-length samples for one epoch.

Each case prints one JSON line: the case, seconds (wall), cpu_seconds (the build's CPU
time: on a shared machine closer to an unloaded run's wall time), output bytes, RSS
before building (after the inputs exist), peak RSS, and peak_over_output =
(peak - before) / output.

    python tools/bench_data_index.py                      # 1e6 and 1e7 samples
    python tools/bench_data_index.py --case blend --samples 1000000 --reference
    python tools/bench_data_index.py --case blend --samples 585937500 --datasets 10 \\
        --stream /tmp/blend          # the DeepSeek-V3 run (manual; docs/benchmarks/)
    python tools/bench_data_index.py --case gpt --documents 100000000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

DEFAULT_CASES = [("blend", 10**6, 10), ("blend", 10**7, 10), ("blend", 10**7, 100),
                 ("gpt", 10**6, 0)]


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Corpus:
    """What GPTDataset reads of an IndexedDataset: lengths and document boundaries."""

    def __init__(self, documents: int, mean_tokens: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.sequence_lengths = rng.integers(1, 2 * mean_tokens, documents, dtype=np.int32)
        self.document_indices = np.arange(documents + 1, dtype=np.int64)
        self.description = {"bench": documents, "mean": mean_tokens, "seed": seed}


def _blend(args) -> dict:
    from megamoe.data.blended_dataset import build_blending_indices
    weights = np.random.default_rng(args.seed).random(args.datasets).tolist()
    before = _rss_bytes("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    if args.stream:
        from megamoe.data.blending_index import write_blending_indices
        os.makedirs(args.stream, exist_ok=True)
        paths = tuple(os.path.join(args.stream, f"{n}.npy") for n in ("dataset", "sample"))
        write_blending_indices(weights, args.samples, paths)
        out_bytes = sum(os.path.getsize(p) for p in paths)
    else:
        arrays = build_blending_indices(weights, args.samples, use_helper=not args.reference)
        out_bytes = sum(a.nbytes for a in arrays)
    seconds = time.perf_counter() - start
    return {"case": "blend", "samples": args.samples, "datasets": args.datasets,
            "stream": bool(args.stream), "python_reference": args.reference,
            "seconds": round(seconds, 3), "cpu_seconds": round(time.process_time() - cpu, 3),
            "output_bytes": out_bytes, "rss_before": before}


def _gpt(args) -> dict:
    from megamoe.data.gpt_dataset import GPTDataset
    corpus = _Corpus(args.documents, args.mean_doc_tokens, args.seed)
    tokens = int(corpus.sequence_lengths.sum(dtype=np.int64))
    samples = (tokens - 1) // args.seq_length
    ids = np.arange(args.documents)
    before = _rss_bytes("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    ds = GPTDataset(corpus, ids, samples, args.seq_length, args.seed, eod=0)
    seconds = time.perf_counter() - start
    arrays = (ds.document_index, ds.sample_index, ds.shuffle_index)
    return {"case": "gpt", "documents": args.documents, "samples": len(ds),
            "seq_length": args.seq_length, "seconds": round(seconds, 3),
            "cpu_seconds": round(time.process_time() - cpu, 3),
            "output_bytes": sum(a.nbytes for a in arrays), "rss_before": before}


def _child(args) -> None:
    result = _blend(args) if args.case == "blend" else _gpt(args)
    result["rss_peak"] = _rss_bytes("VmHWM")
    result["peak_over_output"] = round(
        (result["rss_peak"] - result["rss_before"]) / max(result["output_bytes"], 1), 3)
    print(json.dumps(result), flush=True)


def _run(case: str, n: int, k: int, args) -> None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--case", case,
           "--seed", str(args.seed), "--seq-length", str(args.seq_length),
           "--mean-doc-tokens", str(args.mean_doc_tokens)]
    cmd += (["--samples", str(n), "--datasets", str(k)] if case == "blend"
            else ["--documents", str(n)])
    if args.reference:
        cmd.append("--reference")
    stream = None
    if case == "blend" and args.stream:
        stream = tempfile.mkdtemp(prefix="bench_blend_", dir=args.stream)
        cmd += ["--stream", stream]
    try:
        subprocess.run(cmd, check=True)
    finally:
        if stream:
            shutil.rmtree(stream, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", choices=["blend", "gpt"])
    p.add_argument("--samples", type=int, default=10**6)
    p.add_argument("--datasets", type=int, default=10)
    p.add_argument("--documents", type=int, default=10**6)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--mean-doc-tokens", type=int, default=1000)
    p.add_argument("--stream", default=None, help="blend: write .npy files under this dir")
    p.add_argument("--reference", action="store_true",
                   help="blend: time the pure-Python reference loop instead of the helper")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("samples", "datasets", "documents", "seq_length", "mean_doc_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.child:
        _child(args)
        return
    if args.case is None:
        for case, n, k in DEFAULT_CASES:
            _run(case, n, k, args)
    else:
        _run(args.case, args.samples if args.case == "blend" else args.documents,
             args.datasets, args)


if __name__ == "__main__":
    main()
