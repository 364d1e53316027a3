"""Crash safety and exact resume of pretrain_gpt.py checkpoints.

A real trainer process is SIGKILLed at each point of the publish protocol (a test hook,
MEGAMOE_CKPT_TEST_PAUSE, parks the writer there), then training resumes from the same
--save directory: always from the last complete checkpoint, with the same losses as a run
that never crashed. Exact resume: 2N iterations straight == N + resume + N, bitwise in fp32
(losses, grad norms, parameters, optimizer state), on a real indexed GPT dataset, with
dropout on (so the RNG state is part of what must be restored).
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.data import IndexedDatasetBuilder
from megamoe.training.checkpoint import (
    PAUSE_ENV,
    TRACKER,
    read_checkpoint,
    read_dist_tensors,
    read_tracker,
)
from megamoe.training.run_record import RUN_RECORDS
from tests.training.test_pretrain import ROOT, TINY_MOE
from tests.training.test_train_samples import LINE

SAVE_EVERY = "--train-iters 4 --save-interval 1 --ckpt-keep-last 2"


def _run(extra: str) -> list[dict]:
    args = parse_args(shlex.split(f"{TINY_MOE} {extra}"), world_size=1)
    return pretrain(args, print_fn=lambda _m: None).history


def _start_paused(save: str, phase: str, iteration: int, marker: str,
                  extra: str = "") -> subprocess.Popen:
    # Same intra-op thread count as the in-process runs it is compared with bitwise (the
    # order of a multi-threaded reduction can change the last bit).
    env = dict(os.environ, **{PAUSE_ENV: f"{phase}:{iteration}:{marker}"},
               OMP_NUM_THREADS=str(torch.get_num_threads()))
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
                             *shlex.split(f"{TINY_MOE} {SAVE_EVERY} --save {save} {extra}")],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _kill_at_marker(p: subprocess.Popen, marker: str, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(marker):
        if p.poll() is not None:
            raise AssertionError(f"trainer exited before the pause: {p.stderr.read()[-2000:]}")
        if time.time() > deadline:
            p.kill()
            raise AssertionError("trainer never reached the pause point")
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL


# (phase of the save of iteration 3, last complete checkpoint after the kill)
PHASES = {"before_write": 2, "after_write": 2, "after_publish": 2, "after_tracker": 3,
          "prune": 3}


def _crash_and_resume(tmp_path, phases: list[str], fmt: str) -> None:
    straight = _run("--train-iters 4")
    fmt = f"--ckpt-format {fmt}"
    dirs = {ph: str(tmp_path / ph) for ph in phases}
    markers = {ph: str(tmp_path / f"{ph}.marker") for ph in phases}
    procs = {ph: _start_paused(dirs[ph], ph, 3, markers[ph], fmt) for ph in phases}
    try:
        for ph in phases:
            _kill_at_marker(procs[ph], markers[ph])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    if "after_publish" in dirs:
        # a second crash: resuming re-saves iteration 3 over the orphaned iter_0000003 and
        # is killed between the two renames of that swap
        swap = str(tmp_path / "mid_swap.marker")
        p = _start_paused(dirs["after_publish"], "mid_swap", 3, swap,
                          extra=f"--load {dirs['after_publish']} {fmt}")
        _kill_at_marker(p, swap)
        assert glob.glob(os.path.join(dirs["after_publish"], "iter_0000003.old.*"))

    for phase in phases:
        d, last = dirs[phase], PHASES[phase]
        assert read_tracker(d) == last, phase
        state = read_checkpoint(d)  # the pointer names a complete, readable checkpoint
        assert state["iteration"] == last and state["consumed_train_samples"] == 8 * last
        resumed = _run(f"{SAVE_EVERY} --save {d} --load {d} {fmt}")
        assert [h["iteration"] for h in resumed] == list(range(last + 1, 5)), phase
        for a, b in zip(straight[last:], resumed):
            assert a["lm loss"] == b["lm loss"] and a["grad norm"] == b["grad norm"], phase
        assert read_tracker(d) == 4
        assert sorted(set(os.listdir(d)) - RUN_RECORDS) == \
            ["iter_0000003", "iter_0000004", TRACKER], phase


@pytest.mark.slow  # (the torch_dist case below stays in the default set)
def test_sigkill_during_save_then_resume(tmp_path):
    _crash_and_resume(tmp_path, ["after_write", "after_tracker"], "torch")


def test_sigkill_during_torch_dist_save_then_resume(tmp_path):
    _crash_and_resume(tmp_path, ["before_write", "after_publish"], "torch_dist")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_sigkill_at_every_save_phase_then_resume(tmp_path, fmt):
    _crash_and_resume(tmp_path, list(PHASES), fmt)


@pytest.mark.slow
def test_sigkill_at_random_times_over_many_saves(tmp_path):
    """Kill an unmodified trainer at random moments (mostly mid-training, sometimes
    mid-save) over a loop; every time the pointer names a loadable checkpoint."""
    rng = np.random.default_rng(0)
    d = str(tmp_path / "ckpt")
    args = f"{TINY_MOE} --train-iters 40 --save-interval 1 --ckpt-keep-last 3 --save {d} --load {d}"
    for _ in range(8):
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
                              *shlex.split(args)], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
        time.sleep(3.0 + float(rng.uniform(0.0, 2.0)))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        it = read_tracker(d)
        if it is not None:
            assert read_checkpoint(d)["iteration"] == it
    hist = _run(f"--train-iters 40 --save-interval 1 --ckpt-keep-last 3 --save {d} --load {d}")
    assert read_tracker(d) == 40 and (not hist or hist[-1]["iteration"] == 40)


def _gpt_corpus(prefix: str, eod: int = 96) -> str:  # --vocab-size 97: EOD 96
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix + ".bin", np.int32) as b:
        for _ in range(200):
            b.add_document(list(rng.integers(0, eod, int(rng.integers(5, 40)))) + [eod])
        b.finalize(prefix + ".idx")
    return prefix


def _real_data_args(prefix: str) -> str:
    flags = TINY_MOE.replace("--mock-data ", f"--data-path {prefix} --split 95,5,0 ")
    return flags.replace("--hidden-dropout 0.0 --attention-dropout 0.0",
                         "--hidden-dropout 0.1 --attention-dropout 0.1")


def _train_real(prefix: str, extra: str) -> list[dict]:
    args = parse_args(shlex.split(f"{_real_data_args(prefix)} {extra}"), world_size=1)
    return pretrain(args, print_fn=lambda _m: None).history


@pytest.mark.parametrize("fmt", [pytest.param("torch", marks=pytest.mark.slow), "torch_dist"])
def test_exact_resume_on_gpt_dataset_is_bitwise(tmp_path, fmt):
    prefix = _gpt_corpus(str(tmp_path / "corpus"))
    n = 3
    f = f"--ckpt-format {fmt}"
    straight = _train_real(prefix, f"--train-iters {2 * n} --save {tmp_path / 'a'} {f}")
    first = _train_real(prefix, f"--train-iters {2 * n} --exit-interval {n} "
                                f"--save {tmp_path / 'b'} {f}")
    second = _train_real(prefix, f"--train-iters {2 * n} --load {tmp_path / 'b'} "
                                 f"--save {tmp_path / 'b'} {f}")
    assert [h["iteration"] for h in first + second] == list(range(1, 2 * n + 1))
    for a, b in zip(straight, first + second):
        assert a["lm loss"] == b["lm loss"] and a["grad norm"] == b["grad norm"], (a, b)
        assert a["lr"] == b["lr"]
    sa, sb = read_checkpoint(str(tmp_path / "a")), read_checkpoint(str(tmp_path / "b"))
    assert sa["iteration"] == sb["iteration"] == 2 * n
    assert sa["consumed_train_samples"] == sb["consumed_train_samples"]
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k
    if fmt == "torch_dist":  # every saved tensor (model, Adam states) and the RNG states
        ta, tb = read_dist_tensors(sa["_file"]), read_dist_tensors(sb["_file"])
        assert ta.keys() == tb.keys() and any(k.endswith(".exp_avg_sq") for k in ta)
        for k, v in ta.items():
            assert torch.equal(v, tb[k]), k
        assert torch.equal(sa["rng"][0]["torch"], sb["rng"][0]["torch"])
        return
    oa, ob = sa["optimizer"]["optimizer"]["state"], sb["optimizer"]["optimizer"]["state"]
    assert oa.keys() == ob.keys()
    for i in oa:
        for name, t in oa[i].items():
            assert torch.equal(t, ob[i][name]), (i, name)
    assert torch.equal(sa["rng"]["torch"], sb["rng"]["torch"])


# Sample-based runs (flags, N): (a) the schedule in samples; (b) --rampup-batch-size 2 2 24
# to 8, one increment every 8 samples: batch sizes 2 2 2 2 | 4 4 6 6 8, so the first step
# after the stop at N = 4 is the first with a larger batch.
SAMPLE_RUNS = {
    "lr_samples": ("--train-samples 48 --lr-warmup-samples 12 --lr-decay-samples 40 "
                   "--min-lr 1e-4", 3),
    "rampup": ("--train-samples 36 --rampup-batch-size 2 2 24 --lr-warmup-samples 6", 4),
}


def _logged_batch_sizes(out: list[str]) -> list[int]:
    """Each step's global batch size, from the console lines."""
    return [int(m.group(5)) for line in out for m in [LINE.search(line)] if m]


@pytest.mark.parametrize("name", [pytest.param("lr_samples", marks=pytest.mark.slow), "rampup"])
def test_exact_resume_of_sample_based_training_is_bitwise(tmp_path, name):
    """--train-samples runs stopped after N steps (--exit-interval) and resumed from the
    checkpoint continue bitwise like the run that never stopped (fp32, dropout on, GPT
    dataset): losses, grad norms, rates, batch sizes, data position, saved tensors. The
    ramp-up's batch size and the schedule's position come back from the consumed samples
    and the scheduler state in the checkpoint."""
    flags, n = SAMPLE_RUNS[name]
    prefix = _gpt_corpus(str(tmp_path / "corpus"))
    a, b = tmp_path / "a", tmp_path / "b"
    runs = {}
    for key, extra in (("straight", f"--save {a}"),
                       ("first", f"--exit-interval {n} --save {b}"),
                       ("second", f"--load {b} --save {b}")):
        out: list[str] = []
        args = parse_args(shlex.split(f"{_real_data_args(prefix)} {flags} {extra}"
                                      .replace("--lr-warmup-iters 1 ", "")), world_size=1)
        runs[key] = (pretrain(args, print_fn=out.append).history, _logged_batch_sizes(out))
    (straight, sizes), (first, sizes1), (second, sizes2) = (runs[k] for k in runs)
    assert len(first) == n and [h["iteration"] for h in first + second] == \
        list(range(1, len(straight) + 1))
    assert sizes1 + sizes2 == sizes
    if name == "rampup":
        assert sizes == [2, 2, 2, 2, 4, 4, 6, 6, 8] and sizes2[0] > sizes1[-1]
    for x, y in zip(straight, first + second):
        assert x["lm loss"] == y["lm loss"] and x["grad norm"] == y["grad norm"], (x, y)
        assert x["lr"] == y["lr"]
    sa, sb = read_checkpoint(str(a)), read_checkpoint(str(b))
    assert sa["iteration"] == sb["iteration"] == len(straight)
    assert sa["consumed_train_samples"] == sb["consumed_train_samples"] == sum(sizes)
    assert sa["scheduler"] == sb["scheduler"]
    ta, tb = read_dist_tensors(sa["_file"]), read_dist_tensors(sb["_file"])
    assert ta.keys() == tb.keys() and any(k.endswith(".exp_avg_sq") for k in ta)
    for k, v in ta.items():
        assert torch.equal(v, tb[k]), k


@pytest.mark.parametrize("fmt", [pytest.param("torch", marks=pytest.mark.slow), "torch_dist"])
def test_async_save_matches_blocking_save(tmp_path, fmt):
    f = f"--ckpt-format {fmt}"
    _run(f"--train-iters 3 --save-interval 1 --save {tmp_path / 'sync'} {f}")
    _run(f"--train-iters 3 --save-interval 1 --async-save --ckpt-keep-last 1 "
         f"--save {tmp_path / 'async'} {f}")
    assert sorted(set(os.listdir(tmp_path / "async")) - RUN_RECORDS) == ["iter_0000003", TRACKER]
    a, b = read_checkpoint(str(tmp_path / "sync")), read_checkpoint(str(tmp_path / "async"))
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    if fmt == "torch_dist":  # optimizer states too
        ta, tb = read_dist_tensors(a["_file"]), read_dist_tensors(b["_file"])
        assert ta.keys() == tb.keys()
        for k, v in ta.items():
            assert torch.equal(v, tb[k]), k


def _cli(args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
                           *shlex.split(args)], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)


def _snapshot_tree(d) -> dict:
    return {p: open(p, "rb").read() for p in glob.glob(os.path.join(d, "**"), recursive=True)
            if os.path.isfile(p)}


def _with(flags: str, flag: str, value: str) -> str:
    words = flags.split()
    i = words.index(flag)
    return " ".join(words[:i + 1] + [value] + words[i + 2:])


def _one_line(code: int, err: str, needles: list[str]) -> None:
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("fmt", [pytest.param("torch", marks=pytest.mark.slow), "torch_dist"])
def test_bad_load_is_one_line_and_leaves_save_untouched(tmp_path, capsys, fmt):
    from megamoe.cli.main import main

    f = f"--ckpt-format {fmt}"
    good = str(tmp_path / "good")
    _run(f"--train-iters 2 --save {good} {f}")
    trunc = str(tmp_path / "trunc")
    _run(f"--train-iters 1 --save {trunc} {f}")
    name = "model_optim_rng.pt" if fmt == "torch" else "__0_0.distcp"
    pt = os.path.join(trunc, "iter_0000001", name)
    open(pt, "r+b").truncate(os.path.getsize(pt) // 2)
    before = {d: _snapshot_tree(d) for d in (good, trunc)}
    cases = [  # (flags, words the one line must contain)
        (f"{TINY_MOE} --load {tmp_path / 'missing'} --save {good}",
         ["--load", "missing", "no checkpoint"]),
        (f"{TINY_MOE} --load {trunc} --save {trunc}",
         [name if fmt == "torch" else "iter_0000001", "cannot be read"]),
        (f"{_with(TINY_MOE, '--num-experts', '8')} --load {good} --save {good}",
         ["--num-experts", "num_experts=4"]),
        (f"{_with(TINY_MOE, '--hidden-size', '64')} --load {good} --save {good}",
         ["--hidden-size", "hidden_size=32"]),
    ]
    if fmt == "torch_dist":  # a torch_dist directory without its common.pt
        incomplete = str(tmp_path / "incomplete")
        shutil.copytree(good, incomplete)
        os.remove(os.path.join(incomplete, "iter_0000002", "common.pt"))
        before[incomplete] = _snapshot_tree(incomplete)
        cases.append((f"{TINY_MOE} --load {incomplete} --save {incomplete}",
                      ["iter_0000002", "missing or incomplete"]))
    for flags, needles in cases:
        capsys.readouterr()
        code = main(shlex.split(f"{flags} --train-iters 3"))
        _one_line(code, capsys.readouterr().err, needles)
    p = _cli(f"{cases[1][0]} --train-iters 3")  # the real command line, same one line
    _one_line(p.returncode, p.stderr, cases[1][1])
    assert {d: _snapshot_tree(d) for d in before} == before
