"""pretrain_gpt.py end to end on tiny models: flags, resume, data-parallel parity, bad input."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from tests.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY_MOE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --seq-length 16 --max-position-embeddings 16 --normalization RMSNorm "
    "--position-embedding-type rope --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 "
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-grouped-gemm "
    "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 97 --num-workers 0 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-warmup-iters 1 "
    "--lr-decay-style cosine --log-interval 1 --eval-interval 1000 --eval-iters 0 --seed 7"
)


def _run(extra: str, world_size: int = 1) -> list[dict]:
    args = parse_args(shlex.split(f"{TINY_MOE} {extra}"), world_size=world_size)
    return pretrain(args, print_fn=lambda _msg: None).history


def test_trains_and_logs_moe_losses():
    hist = _run("--train-iters 3")
    assert [h["iteration"] for h in hist] == [1, 2, 3]
    for h in hist:
        assert torch.isfinite(torch.tensor(h["lm loss"]))
        assert h["load_balancing_loss"] > 0.5  # logged as loss/coeff: ~1 when balanced
        assert "z_loss" in h


def test_stale_moe_losses_from_an_earlier_run_are_not_logged():
    from megamoe.moe.losses import MoELossTracker

    clean = _run("--train-iters 1")[0]["load_balancing_loss"]
    MoELossTracker.record("load_balancing_loss", 0, 2, torch.tensor(5.0))  # left behind
    assert _run("--train-iters 1")[0]["load_balancing_loss"] == clean


def _dry_run_memory(extra: str, world_size: int) -> dict:
    out: list[str] = []
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 --dry-run --json {extra}"),
                      world_size=world_size)
    pretrain(args, print_fn=out.append)
    return json.loads(out[-1])["per_rank_memory_bytes"]


def test_dry_run_reports_per_rank_memory_of_the_layout():
    from megamoe.cli.mapping import run_config_from_args
    from megamoe.planning.memory import Layout, model_bytes

    layout = ("--tensor-model-parallel-size 2 --sequence-parallel "
              "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2 "
              "--use-distributed-optimizer --global-batch-size 4")
    single = _dry_run_memory("", 1)
    split = _dry_run_memory(layout, 8)
    # (the layout's TP decides the padded vocabulary: 97 ids to a multiple of 128 x 2)
    cfg = run_config_from_args(parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 {layout}"),
                                     world_size=8), 97).model
    lay = Layout(tp=2, pp=2, vpp=1, ep=2, etp=2, dp=2, cp=1, distributed_optimizer=True,
                 recompute="none", micro_batch_size=2)
    want = model_bytes(cfg, lay, 4)
    assert split["weights"] == int(want["weights"])
    assert split["optimizer"] == int(want["optimizer"])
    assert split["total"] < single["total"] and split["activations"] > 0


def test_mixtral_script_flags_run_in_one_process():
    from tests.test_arguments import MIXTRAL_SCRIPT

    args = parse_args(MIXTRAL_SCRIPT.split(), world_size=1)
    hist = pretrain(args, print_fn=lambda _m: None).history
    assert len(hist) == 3 and all(h["lm loss"] == h["lm loss"] for h in hist)


def test_resume_continues_exactly(tmp_path):
    straight = _run("--train-iters 4")
    ckpt = tmp_path / "ckpt"
    _run(f"--train-iters 4 --exit-interval 2 --save {ckpt} --save-interval 2")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = _run(f"--train-iters 4 --load {ckpt}")
    assert [h["iteration"] for h in resumed] == [3, 4]
    for a, b in zip(straight[2:], resumed):
        assert a["lm loss"] == b["lm loss"], (a, b)


def _dp_worker(rank: int, world_size: int) -> list[float]:
    return [h["lm loss"] for h in _run("--train-iters 3", world_size=world_size)]


def test_data_parallel_matches_single_process():
    single = [h["lm loss"] for h in _run("--train-iters 3")]
    per_rank = run_distributed(_dp_worker, 2, timeout=120)
    for losses in per_rank:
        for a, b in zip(single, losses):
            assert abs(a - b) <= 1e-5 * abs(a), (single, losses)


GLOBAL_AUX = ("--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-1 "
              "--global-batch-size 4 --train-iters 3")


def _global_aux_worker(rank: int, world_size: int) -> list[dict]:
    return _run(f"{GLOBAL_AUX} --micro-batch-size 2", world_size=world_size)


@pytest.mark.slow  # (default-set budget: a representative case stays)
def test_global_aux_loss_data_parallel_matches_single_process():
    """One micro-batch per rank: token counts summed over DP ranks give the single-process
    global batch's loss, and DP-averaged gradients its gradient (Megatron #3672)."""
    single = _run(f"{GLOBAL_AUX} --micro-batch-size 4")
    for hist in run_distributed(_global_aux_worker, 2, 120):
        for a, b in zip(single, hist):
            for key in ("lm loss", "global_load_balancing_loss", "grad norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, single, hist)


def _cli(args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
                           *shlex.split(args)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_corrupt_dataset_is_one_line(tmp_path):
    prefix = tmp_path / "corpus"
    (tmp_path / "corpus.bin").write_bytes(b"\x00" * 64)
    (tmp_path / "corpus.idx").write_bytes(b"NOTANIDX" + b"\x00" * 40)
    base = TINY_MOE.replace("--mock-data ", "")
    p = _cli(f"{base} --data-path {prefix} --train-iters 1")
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "corpus.idx" in lines[0] and "Traceback" not in p.stderr


@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", os.path.join(ROOT, "pretrain_gpt.py"),
                        *shlex.split(TINY_MOE), "--train-iters", "2"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "iteration        2/       2" in p.stdout
