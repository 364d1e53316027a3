#!/usr/bin/env python
"""Benchmark: samples/s and tokens/s of the training data loader, next to the GPU step
rate it must feed, and the --num-workers a GPU rank needs.

The loader is pretrain_gpt.py's own, built from pretrain_gpt.py flags by the same calls
(parse_args -> RunConfig -> split_num_samples -> build_gpt_datasets -> run_iterator):
GPTDataset samples of each prefix, a BlendedDataset over the prefixes, Megatron's
pretraining sampler, collation and DataLoader workers. Its input is a generated corpus
(random tokens, random document lengths, an EOD closing each document) written with
megamoe's IndexedDatasetBuilder into a temporary directory as --datasets prefixes of
--total-mb in all, blended with unequal weights. For each --seq-lengths x --num-workers
case it times --batches micro-batches after --warmup ones; the warm-up batches are
checked equal to the dataset's own samples (the loader reorders or drops nothing).

The step rate is the planner's (megamoe/planning/planner.py step_time) for the exact
layout of scripts/pretrain_mixtral_8x7b.sh and scripts/pretrain_deepseek_v3.sh: each
script runs with DRY_RUN=1 and a stand-in interpreter that only records the flags it
would pass pretrain_gpt.py, so a change to a script changes the numbers here. Every rank
of a data-parallel replica (its TP, PP, CP and EP peers) reads the same micro-batches, so
one rank's loader must deliver global_batch / DP samples per step. Workers needed =
ceil(--safety-factor x needed / one worker's measured rate).

    python tools/bench_data_loader.py                       # 300 MB, seq 4096 and 8192
    python tools/bench_data_loader.py --json-out docs/benchmarks/data_loader.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megamoe.cli.arguments import OneLineArgumentParser, parse_args  # noqa: E402
from megamoe.cli.mapping import config_from_args, run_config_from_args  # noqa: E402
from megamoe.config import DataConfig  # noqa: E402
from megamoe.data import IndexedDatasetBuilder, build_gpt_datasets, tokenizer_for  # noqa: E402
from megamoe.data.atomic import publish, tmp_path_for  # noqa: E402
from megamoe.data.indexed_dataset import optimal_dtype  # noqa: E402
from megamoe.data.loaders import collate, run_iterator  # noqa: E402
from megamoe.planning.dry_run import launch_layout  # noqa: E402
from megamoe.planning.planner import Hardware, step_time  # noqa: E402
from megamoe.training.pretrain import split_num_samples  # noqa: E402

# The launch scripts whose layouts the loader must feed, with their positional arguments.
SCRIPTS = {"mixtral_8x7b": ("scripts/pretrain_mixtral_8x7b.sh", ["CKPT", "TOKENIZER", "DATA"]),
           "deepseek_v3": ("scripts/pretrain_deepseek_v3.sh", ["CKPT", "DATA"])}
# A stand-in for the scripts' $PYTHON: prints the flags and world size it was given.
_RECORDER = ("import json, os, sys\n"
             "print(json.dumps({'argv': sys.argv[2:], 'world_size': os.environ['WORLD_SIZE']}))\n")
GENERATE_CHUNK = 1 << 23  # tokens generated and written at once


class BenchError(Exception):
    """A launch script that does not give its flags: one line, exit 1."""


def write_corpus(directory: str, datasets: int, total_bytes: int, vocab_size: int,
                 mean_doc_tokens: int, seed: int) -> list[str]:
    """`datasets` prefixes of random documents (lengths uniform in [1, 2 x mean], tokens
    below the EOD id, an EOD last: what preprocess_data.py --append-eod writes), about
    total_bytes of .bin in all, written with megamoe's IndexedDatasetBuilder."""
    dtype = np.dtype(optimal_dtype(vocab_size))
    eod = vocab_size - 1  # NullTokenizer's EOD
    rng = np.random.default_rng(seed)
    per_dataset = max(1, total_bytes // datasets // dtype.itemsize)
    prefixes = []
    for k in range(datasets):
        prefix = os.path.join(directory, f"corpus_{k}")
        lengths = rng.integers(1, 2 * mean_doc_tokens + 1, per_dataset // mean_doc_tokens + 1)
        with IndexedDatasetBuilder(prefix + ".bin", dtype) as builder:
            start = 0
            while start < len(lengths):
                take = max(1, int(np.searchsorted(np.cumsum(lengths[start:]), GENERATE_CHUNK)))
                docs = lengths[start:start + take]
                tokens = rng.integers(0, eod, int(docs.sum()), dtype=dtype)
                tokens[np.cumsum(docs) - 1] = eod
                builder.add_packed(tokens.tobytes(), docs, np.ones(len(docs), np.int64))
                start += take
            builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    return prefixes


def blend_weights(datasets: int) -> list[float]:
    """Unequal weights 1, 2, ..., K (normalised by the blend)."""
    return [float(k + 1) for k in range(datasets)]


def loader_flags(prefixes: list[str], seq_length: int, num_workers: int, samples: int,
                 args: argparse.Namespace, cache: str) -> list[str]:
    """pretrain_gpt.py flags of a run that reads this blend (the model is irrelevant to the
    loader: the smallest one that validates; the split is the launch scripts')."""
    data_path = [str(x) for w, p in zip(blend_weights(len(prefixes)), prefixes) for x in (w, p)]
    mbs = args.micro_batch_size
    return ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs),
            "--train-iters", str(math.ceil(samples / mbs)), "--eval-iters", "0",
            "--lr", "1e-4", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(args.vocab_size), "--data-path", *data_path,
            "--split", "99990,8,2", "--num-workers", str(num_workers),
            "--data-cache-path", cache, "--seed", str(args.seed)]


def build_run(flags: list[str]):
    """(run config, train dataset, seconds to build or map its indices) as pretrain_gpt.py
    gets them."""
    ns = parse_args(flags, world_size=1, prog="bench_data_loader.py")
    tokenizer = tokenizer_for(config_from_args(DataConfig, ns))
    run = run_config_from_args(ns, tokenizer.vocab_size)
    start = time.perf_counter()
    train = build_gpt_datasets(run.data, tokenizer, split_num_samples(run),
                               seq_length=run.model.seq_length, seed=run.train.seed)[0]
    return run, train, time.perf_counter() - start


def _equal(batch: dict, expected: dict) -> bool:
    return batch.keys() == expected.keys() and all(torch.equal(batch[k], expected[k])
                                                   for k in batch)


def _workers_cpu_s(it) -> float:
    """User + system CPU seconds of a DataLoader iterator's worker processes so far (from
    /proc; 0 without workers): what producing the samples cost, whatever else runs."""
    total = 0.0
    for worker in getattr(it, "_workers", []):
        try:
            with open(f"/proc/{worker.pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(run, train, batches: int, warmup: int) -> dict:
    """Time `batches` micro-batches of one rank (DP 1) after `warmup` ones, each warm-up
    batch checked equal to the dataset's samples at the sampler's indices."""
    mbs = run.train.micro_batch_size
    start = time.perf_counter()
    it = run_iterator(run, train, 0, 0, 1)
    try:
        for k in range(warmup):
            batch = next(it)
            if k == 0:
                first_batch_s = time.perf_counter() - start
            expected = collate([train[i] for i in range(k * mbs, (k + 1) * mbs)])
            if not _equal(batch, expected):
                raise AssertionError(f"loader batch {k} differs from the dataset's samples")
        cpu, workers_cpu = time.process_time(), _workers_cpu_s(it)
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        seconds = time.perf_counter() - start
        main_cpu = time.process_time() - cpu
        workers_cpu = _workers_cpu_s(it) - workers_cpu
    finally:
        del it  # persistent workers exit with their iterator
    workers, seq = run.data.num_workers, run.model.seq_length
    samples_per_s = batches * mbs / seconds
    return {"seq_length": seq, "num_workers": workers, "micro_batch_size": mbs,
            "batches": batches, "seconds": round(seconds, 4),
            "samples_per_s": round(samples_per_s, 2),
            "tokens_per_s": round(samples_per_s * seq, 1),
            "per_worker_samples_per_s": round(samples_per_s / max(workers, 1), 2),
            "main_process_cpu_ms_per_batch": round(1e3 * main_cpu / batches, 3),
            "workers_cpu_s": round(workers_cpu, 2),
            # what one worker would make on a core of its own (its CPU time per sample)
            "samples_per_worker_cpu_s": (round(batches * mbs / workers_cpu, 1)
                                         if workers and workers_cpu > 0 else None),
            "first_batch_s": round(first_batch_s, 4), "verified_batches": warmup}


def script_launch(name: str, scratch: str) -> tuple[list[str], int]:
    """(the pretrain_gpt.py flags, world size) scripts/<name> launches with DRY_RUN=1."""
    script, positional = SCRIPTS[name]
    recorder = os.path.join(scratch, "record_flags")
    with open(recorder, "w", encoding="utf-8") as f:
        f.write(f"#!{sys.executable}\n{_RECORDER}")
    os.chmod(recorder, 0o755)
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": recorder}
    p = subprocess.run(["bash", os.path.join(ROOT, script), *positional], env=env,
                       capture_output=True, text=True, timeout=120)
    lines = p.stdout.strip().splitlines()
    if p.returncode or not lines:
        why = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"{script} DRY_RUN=1 exited {p.returncode}: {why}")
    record = json.loads(lines[-1])
    return record["argv"], int(record["world_size"])


def planner_row(argv: list[str], world_size: int, seq_length: int, gpu_memory_gb: float
                ) -> dict:
    """The planner's step for the script's layout at `seq_length` (its last flag wins, as
    an extra flag after the script's own does)."""
    ns = parse_args(argv + ["--seq-length", str(seq_length)], world_size=world_size,
                    prog="bench_data_loader.py")
    run = run_config_from_args(ns, ns.vocab_size)
    layout = launch_layout(run)
    hw = Hardware(gpus=world_size, gpu_memory_gb=gpu_memory_gb)
    gbs = run.train.global_batch_size
    t = step_time(run.model, layout, hw, seq_length, gbs)["total"]
    tokens = gbs * seq_length
    return {"seq_length": seq_length, "world_size": world_size, "global_batch_size": gbs,
            "data_parallel_size": layout.dp,
            "layout": asdict(layout),
            "predicted_step_s": round(t, 4),
            "predicted_tokens_per_s_per_gpu": round(tokens / t / world_size, 1),
            "loader_samples_per_s_needed_per_rank": round(gbs / layout.dp / t, 4),
            "loader_tokens_per_s_needed_per_rank": round(tokens / layout.dp / t, 1)}


def workers_needed(row: dict, cases: list[dict], safety: float) -> dict:
    """One worker's rate at the row's sequence length (the 1-worker case; else the
    main process's) against the rank's need."""
    same = [c for c in cases if c["seq_length"] == row["seq_length"]]
    pick = ([c for c in same if c["num_workers"] == 1] or [c for c in same
                                                          if c["num_workers"] == 0])
    if not pick:
        return {}
    rate = pick[0]["per_worker_samples_per_s"]
    need = row["loader_samples_per_s_needed_per_rank"]
    return {"one_worker_samples_per_s": rate, "headroom": round(rate / need, 1),
            "workers_needed": max(1, math.ceil(safety * need / rate))}


def planner_section(seq_lengths: list[int], cases: list[dict], args, scratch: str) -> dict:
    out = {}
    for name in SCRIPTS:
        argv, world = script_launch(name, scratch)
        rows = []
        for seq in seq_lengths:
            row = planner_row(argv, world, seq, args.gpu_memory_gb)
            row.update(workers_needed(row, cases, args.safety_factor))
            rows.append(row)
        script_seq = parse_args(argv, world_size=world,
                                prog="bench_data_loader.py").seq_length
        out[name] = {"script": SCRIPTS[name][0], "script_seq_length": script_seq,
                     "rows": rows}
    return out


def parse_cli(argv=None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="bench_data_loader.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--num-workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--datasets", type=int, default=4, help="blended prefixes")
    p.add_argument("--total-mb", type=float, default=300.0, help="corpus .bin size, all")
    p.add_argument("--mean-doc-tokens", type=int, default=1500)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--batches", type=int, default=2000, help="timed micro-batches per case")
    p.add_argument("--warmup", type=int, default=8, help="untimed, checked micro-batches")
    p.add_argument("--safety-factor", type=float, default=2.0)
    p.add_argument("--gpu-memory-gb", type=float, default=80.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--work-dir", default=None, help="parent of the temporary corpus")
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    for name in ("datasets", "mean_doc_tokens", "micro_batch_size", "batches", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("total_mb", "safety_factor", "gpu_memory_gb"):
        if not math.isfinite(getattr(args, name)) or getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive number")
    if args.safety_factor < 1:
        p.error("--safety-factor must be >= 1")
    if not 2 <= args.vocab_size <= 1 << 31:
        p.error(f"--vocab-size must be in [2, 2^31], got {args.vocab_size}")
    if any(s < 1 for s in args.seq_lengths) or any(w < 0 for w in args.num_workers):
        p.error("--seq-lengths must be >= 1 and --num-workers >= 0")
    if args.work_dir is not None and not os.path.isdir(args.work_dir):
        p.error(f"--work-dir {args.work_dir}: not a directory")
    return args


def run_benchmark(args: argparse.Namespace, work: str) -> dict:
    start = time.perf_counter()
    prefixes = write_corpus(work, args.datasets, int(args.total_mb * 2**20), args.vocab_size,
                            args.mean_doc_tokens, args.seed)
    corpus_bytes = sum(os.path.getsize(p + ".bin") for p in prefixes)
    written_s = time.perf_counter() - start
    cases = []
    samples = (args.warmup + args.batches) * args.micro_batch_size
    for seq in args.seq_lengths:
        for workers in args.num_workers:
            flags = loader_flags(prefixes, seq, workers, samples, args,
                                 os.path.join(work, "cache"))
            run, train, index_s = build_run(flags)
            case = measure(run, train, args.batches, args.warmup)
            case["index_s"] = round(index_s, 4)
            cases.append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)
    return {"corpus": {"datasets": args.datasets, "weights": blend_weights(args.datasets),
                       "bytes": corpus_bytes, "tokens": corpus_bytes // np.dtype(
                           optimal_dtype(args.vocab_size)).itemsize,
                       "vocab_size": args.vocab_size, "mean_doc_tokens": args.mean_doc_tokens,
                       "write_s": round(written_s, 2)},
            "cases": cases,
            "planner": planner_section(args.seq_lengths, cases, args, work),
            "safety_factor": args.safety_factor,
            "host": {"cpus": os.cpu_count(), "torch": torch.__version__,
                     "loadavg_1min": round(os.getloadavg()[0], 2)}}


def main(argv=None) -> int:
    args = parse_cli(argv)
    work = tempfile.mkdtemp(prefix="bench_loader_", dir=args.work_dir)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # index-build log lines: stdout is JSON
            result = run_benchmark(args, work)
    except BenchError as e:
        sys.stderr.write(f"bench_data_loader.py: error: {e}\n")
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json_out:
        tmp = tmp_path_for(args.json_out)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        publish(tmp, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
