"""Megatron's --wandb-entity (wandb.init's entity, only when given, as Megatron's
global_vars) and --timing-log-option (megatron/core/timers.py Timers.log's three blocks:
max, (min, max), every rank)."""

from __future__ import annotations

import shlex
import sys
import types

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.metrics import MetricsLogger
from megamoe.training.timers import Timers, format_timers
from tests.distributed import run_distributed
from tests.training.test_pretrain import TINY_MOE


def test_wandb_entity_reaches_wandb_init(tmp_path, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or fake, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    MetricsLogger(None, "proj", "exp", str(tmp_path), wandb_entity="team-a")
    MetricsLogger(None, "proj", "exp", str(tmp_path))
    assert calls[0]["entity"] == "team-a" and calls[0]["project"] == "proj"
    assert "entity" not in calls[1]  # W&B's own default entity, as Megatron


def test_wandb_entity_needs_a_project(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 --wandb-entity t"), world_size=1)
    assert e.value.code == 2 and capsys.readouterr().err == (
        "pretrain_gpt.py: error: --wandb-entity needs --wandb-project (W&B logs only with a "
        "project)\n")


def test_timing_log_options_format_megatrons_blocks():
    """Two ranks' seconds per iteration: Megatron's three blocks, in milliseconds."""
    times = {"forward-backward": [0.25, 0.5], "optimizer": [0.125, 0.0625]}
    assert format_timers(times, "minmax") == (
        "(min, max) time across ranks (ms):\n"
        "    forward-backward ...............................: (250.00, 500.00)\n"
        "    optimizer ......................................: (62.50, 125.00)")
    assert format_timers(times, "max") == (
        "max time across ranks (ms):\n"
        "    forward-backward ...............................: 500.00\n"
        "    optimizer ......................................: 125.00")
    assert format_timers(times, "all") == (
        "times across ranks (ms):\n  forward-backward:\n     rank  0: 250.00\n"
        "     rank  1: 500.00\n  optimizer:\n     rank  0: 125.00\n     rank  1: 62.50")


def test_one_process_run_prints_the_chosen_block():
    lines: list[str] = []
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 2 --log-interval 2 "
                                  "--timing-log-level 1 --timing-log-option all"), world_size=1)
    pretrain(args, print_fn=lines.append)
    block = next(s for s in lines if s.startswith("times across ranks (ms):"))
    assert [s.strip().split(":")[0] for s in block.splitlines()[1:]] == [
        "forward-backward", "rank  0", "optimizer", "rank  0"]


def _per_rank_worker(rank: int, world_size: int) -> dict:
    timers = Timers(1, torch.device("cpu"))
    timers.elapsed = {"forward-backward": 1.0 + rank, "optimizer": 0.5 * (rank + 1)}
    return timers.per_rank(2, distributed=True)


@pytest.mark.slow
def test_per_rank_table_holds_every_ranks_time():
    """Three gloo ranks: each rank's own seconds per iteration (elapsed / 2) in its slot,
    the same table on every rank."""
    tables = run_distributed(_per_rank_worker, 3, 120)
    want = {"forward-backward": [0.5, 1.0, 1.5], "optimizer": [0.25, 0.5, 0.75]}
    assert all(t == want for t in tables)


def _lrs(extra: str) -> list[float]:
    args = parse_args(shlex.split(f"{TINY_MOE} {extra}"), world_size=1)
    return [h["lr"] for h in pretrain(args, print_fn=lambda _m: None).history]


def test_schedule_comes_from_the_command_line(tmp_path):
    """--override-opt_param-scheduler (Megatron's): resumed with another --lr, min LR and
    decay length, the schedule is the new command line's at the restored step, the same
    as a run that had those flags from the start; only the step count is the
    checkpoint's."""
    old = "--lr 1e-3 --train-iters 4 --lr-decay-iters 4"
    new = "--lr 3e-3 --min-lr 1e-4 --train-iters 4 --lr-decay-iters 8"
    save = tmp_path / "run"
    _lrs(f"{old} --exit-interval 2 --save {save}")
    resumed = _lrs(f"{new} --load {save} --override-opt_param-scheduler")
    assert len(resumed) == 2 and resumed == _lrs(new)[2:]
