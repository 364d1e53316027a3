"""torch_dist saving as Megatron's checkpoint flags ask (training/checkpoint/save_planner.py):
--ckpt-assume-constant-structure plans the first save only and reuses that plan (every
save still writes its own iteration's values); --no-ckpt-fully-parallel-save writes a
tensor the data-parallel replicas share from the lowest rank instead of spreading such
tensors over the replicas (Megatron's fully parallel save, the default);
--save-retain-interval deletes each previous checkpoint that is not a multiple of it."""

from __future__ import annotations

import os
import shlex

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.checkpoint import read_dist_tensors
from megamoe.training.checkpoint.safe_load import read_dcp_metadata
from tests.distributed import run_distributed
from tests.training.test_pretrain import TINY_MOE


def _train(extra: str, world_size: int = 1) -> None:
    args = parse_args(shlex.split(f"{TINY_MOE} {extra}"), world_size=world_size)
    pretrain(args, print_fn=lambda _m: None)


def test_constant_structure_plans_once_and_every_save_has_its_values(tmp_path, monkeypatch):
    """Three saves (iterations 1, 2, 3): without the flag DCP plans each save; with it,
    once. The last checkpoint holds iteration 3's tensors either way (the same run, same
    process: bitwise)."""
    plans = []
    original = DefaultSavePlanner._create_global_plan

    def counted(self, all_plans):
        plans.append(self._cached_plans_key)
        return original(self, all_plans)

    monkeypatch.setattr(DefaultSavePlanner, "_create_global_plan", counted)
    run = "--train-iters 3 --save-interval 1 --ckpt-keep-last 1"
    _train(f"{run} --save {tmp_path / 'plain'}")
    assert len(plans) == 3
    plans.clear()
    _train(f"{run} --save {tmp_path / 'cached'} --ckpt-assume-constant-structure")
    assert len(plans) == 1 and plans[0].startswith("megamoe-save-plan-")
    plain = read_dist_tensors(str(tmp_path / "plain" / "iter_0000003"))
    cached = read_dist_tensors(str(tmp_path / "cached" / "iter_0000003"))
    assert plain.keys() == cached.keys() and any(k.startswith("optimizer.") for k in plain)
    for key, t in plain.items():
        assert torch.equal(t, cached[key]), key


def test_flags_need_torch_dist(capsys):
    for flag in ("--no-ckpt-fully-parallel-save", "--ckpt-assume-constant-structure"):
        with pytest.raises(SystemExit) as e:
            parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 --save /tmp/x "
                                   f"--ckpt-format torch {flag}"), world_size=1)
        assert e.value.code == 2
        assert capsys.readouterr().err == (
            f"pretrain_gpt.py: error: {flag} sets how torch_dist checkpoints are saved: it "
            f"needs --ckpt-format torch_dist, got torch\n")


def _bytes_per_rank(ckpt_dir: str) -> dict[int, int]:
    """Bytes of tensor data in each rank's DCP files (__<rank>_<n>.distcp)."""
    meta = read_dcp_metadata(os.path.join(ckpt_dir, ".metadata"))
    out: dict[int, int] = {}
    for info in meta.storage_data.values():
        rank = int(info.relative_path.split("_")[2])
        out[rank] = out.get(rank, 0) + info.length
    return out


def _dp2_worker(rank: int, world_size: int, extra: str) -> None:
    _train(extra, world_size)


@pytest.mark.slow
def test_fully_parallel_save_spreads_replicated_tensors(tmp_path):
    """DP=2, the plain optimizer: every tensor is replicated. Megatron's default spreads the
    writing over both replicas; --no-ckpt-fully-parallel-save writes all from rank 0. The
    two checkpoints hold the same tensors."""
    run = "--train-iters 1 --save-interval 1"
    spread, lowest = str(tmp_path / "spread"), str(tmp_path / "lowest")
    run_distributed(_dp2_worker, 2, 300, f"{run} --save {spread}")
    run_distributed(_dp2_worker, 2, 300, f"{run} --save {lowest} --no-ckpt-fully-parallel-save")
    spread, lowest = (os.path.join(d, "iter_0000001") for d in (spread, lowest))
    by_rank = _bytes_per_rank(spread)
    assert by_rank.get(0, 0) > 0 and by_rank.get(1, 0) > 0
    assert set(_bytes_per_rank(lowest)) == {0}
    a, b = read_dist_tensors(spread), read_dist_tensors(lowest)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt", [pytest.param("torch_dist", marks=pytest.mark.slow), "torch"])
def test_save_retain_interval_keeps_its_multiples_and_the_latest(tmp_path, fmt):
    """Megatron's --save-retain-interval 2 with a save every iteration: each save deletes
    the one before unless its iteration is even; with --ckpt-keep-last 2 as well, only the
    newest two of those stay. The latest loads."""
    run = f"--train-iters 5 --save-interval 1 --save-retain-interval 2 --ckpt-format {fmt}"
    _train(f"{run} --save {tmp_path / 'a'}")
    assert sorted(p for p in os.listdir(tmp_path / "a") if p.startswith("iter_")) == [
        "iter_0000002", "iter_0000004", "iter_0000005"]
    _train(f"{run} --save {tmp_path / 'b'} --ckpt-keep-last 2")
    assert sorted(p for p in os.listdir(tmp_path / "b") if p.startswith("iter_")) == [
        "iter_0000004", "iter_0000005"]
    _train(f"--train-iters 6 --load {tmp_path / 'a'} --ckpt-format {fmt}")
