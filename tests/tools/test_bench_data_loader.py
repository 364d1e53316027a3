"""tools/bench_data_loader.py: the benchmark runs tiny and prints its JSON, and the loader
it times (pretrain_gpt.py's, over a blend of generated datasets) yields exactly the
samples a naive reference cuts from the raw token files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tools import bench_data_loader as bench

TINY = ["--total-mb", "0.5", "--datasets", "3", "--seq-lengths", "32", "64",
        "--num-workers", "0", "1", "--batches", "6", "--warmup", "3",
        "--mean-doc-tokens", "40", "--vocab-size", "1000"]


def test_tiny_run_prints_the_json_it_writes(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert bench.main(TINY + ["--work-dir", str(tmp_path), "--json-out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # corpus removed
    corpus = printed["corpus"]
    assert corpus["datasets"] == 3 and corpus["tokens"] * 2 == corpus["bytes"] > 0
    cases = printed["cases"]
    assert [(c["seq_length"], c["num_workers"]) for c in cases] == [
        (32, 0), (32, 1), (64, 0), (64, 1)]
    for c in cases:
        assert c["batches"] == 6 and c["verified_batches"] == 3 and c["samples_per_s"] > 0
        assert c["main_process_cpu_ms_per_batch"] >= 0 and c["workers_cpu_s"] >= 0
        if c["num_workers"] == 0:  # (a worker's CPU is read in clock ticks: may be 0 here)
            assert c["workers_cpu_s"] == 0 and c["samples_per_worker_cpu_s"] is None
        assert c["tokens_per_s"] == pytest.approx(c["samples_per_s"] * c["seq_length"],
                                                  rel=1e-3)  # (both rounded)
    assert set(printed["planner"]) == {"mixtral_8x7b", "deepseek_v3"}
    mixtral = printed["planner"]["mixtral_8x7b"]
    assert mixtral["script_seq_length"] == 2048  # the script's own --seq-length
    for model in printed["planner"].values():
        assert [r["seq_length"] for r in model["rows"]] == [32, 64]
        for r in model["rows"]:
            gbs, step, dp = r["global_batch_size"], r["predicted_step_s"], r["data_parallel_size"]
            assert r["predicted_tokens_per_s_per_gpu"] == pytest.approx(
                gbs * r["seq_length"] / step / r["world_size"], rel=1e-3)
            need = r["loader_samples_per_s_needed_per_rank"]
            assert need == pytest.approx(gbs / dp / step, rel=1e-3)
            one = next(c for c in cases if c["seq_length"] == r["seq_length"]
                       and c["num_workers"] == 1)
            assert r["one_worker_samples_per_s"] == one["per_worker_samples_per_s"]
            assert r["workers_needed"] == max(1, math.ceil(2.0 * need / one[
                "per_worker_samples_per_s"]))
    layouts = {m: v["rows"][0]["layout"] for m, v in printed["planner"].items()}
    assert (layouts["mixtral_8x7b"]["tp"], layouts["mixtral_8x7b"]["ep"],
            printed["planner"]["mixtral_8x7b"]["rows"][0]["world_size"]) == (4, 4, 16)
    assert (layouts["deepseek_v3"]["pp"], layouts["deepseek_v3"]["ep"],
            printed["planner"]["deepseek_v3"]["rows"][0]["world_size"]) == (8, 64, 512)


def _raw_documents(prefix: str, eod: int) -> list[np.ndarray]:
    """The documents of a .bin read without its .idx: each one ends at its EOD."""
    tokens = np.fromfile(prefix + ".bin", dtype=np.uint16).astype(np.int64)
    ends = np.flatnonzero(tokens == eod) + 1
    assert ends[-1] == len(tokens)
    return np.split(tokens, ends[:-1])


def test_loader_samples_equal_a_naive_cut_of_the_raw_files(tmp_path):
    """Every sample of pretrain_gpt.py's loader (a worker process, micro-batches of 2) equals
    the reference: the blend's choice (dataset d, sample s), that dataset's shuffled sample
    j = the S + 1 tokens at j x S of its documents concatenated in document-index order."""
    args = bench.parse_cli(TINY + ["--micro-batch-size", "2"])
    eod, seq, n = args.vocab_size - 1, 16, 60
    prefixes = bench.write_corpus(str(tmp_path), 3, 60_000, args.vocab_size, 40, args.seed)
    run, train, _ = bench.build_run(bench.loader_flags(prefixes, seq, 1, n, args,
                                                       str(tmp_path / "cache")))
    got = list(bench.run_iterator(run, train, 0, 0, 1))
    assert len(got) == len(train) // 2 >= n // 2
    streams = [np.concatenate([_raw_documents(p, eod)[int(i)] for i in ds.document_index])
               for p, ds in zip(prefixes, train.datasets)]
    counts = np.bincount(np.asarray(train.dataset_index), minlength=3)
    assert all(counts > 0)  # every dataset of the blend is read
    for i in range(2 * len(got)):
        d, s = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        j = int(train.datasets[d].shuffle_index[s])
        text = torch.from_numpy(streams[d][j * seq:(j + 1) * seq + 1])
        batch, row = got[i // 2], i % 2
        assert torch.equal(batch["tokens"][row], text[:-1]), i
        assert torch.equal(batch["labels"][row], text[1:]), i
        assert torch.equal(batch["position_ids"][row], torch.arange(seq))
        assert torch.equal(batch["loss_mask"][row], torch.ones(seq))


def test_bad_flags_exit_2_with_one_line(tmp_path, capsys):
    for bad in (["--batches", "0"], ["--safety-factor", "0.5"], ["--total-mb", "nan"],
                ["--work-dir", str(tmp_path / "missing")], ["--num-workers", "-1"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_cli(bad)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        assert err[0].startswith("bench_data_loader.py: error: --"), err


def test_a_launch_script_that_fails_is_named(tmp_path, monkeypatch):
    script = tmp_path / "broken.sh"
    script.write_text("echo 'broken.sh: no such preset' >&2; exit 2\n")
    monkeypatch.setitem(bench.SCRIPTS, "broken", (str(script), []))
    with pytest.raises(bench.BenchError, match=r"broken\.sh DRY_RUN=1 exited 2: broken\.sh: "
                                               r"no such preset"):
        bench.script_launch("broken", str(tmp_path))
