"""Checkpoints written by earlier megamoe commits keep loading.

tests/fixtures/checkpoints_v1 holds the format of commit 3ad34ff, written before the
re-layering: a single-process `--ckpt-format torch` run and a 2-rank EP=2 `torch_dist` run
with the distributed optimizer, 2 iterations of tests' TINY_MOE each,
with the logits `from_checkpoint` gave on fixed tokens when they were written. Their stored
config dicts have the old flat shape (execution and training settings inside "moe").
"""

from __future__ import annotations

import os
import shlex
import shutil

import pytest
import torch

from megamoe import from_checkpoint
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from tests.distributed import run_distributed
from tests.training.test_pretrain import TINY_MOE

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures",
                        "checkpoints_v1")
NAMES = ("torch_single", "torch_dist_ep2")


@pytest.mark.parametrize("name", NAMES)
def test_old_checkpoint_gives_its_recorded_logits(name):
    expected = torch.load(os.path.join(FIXTURES, "expected_logits.pt"), weights_only=True)
    model = from_checkpoint(os.path.join(FIXTURES, name))
    with torch.no_grad():
        assert torch.equal(model(expected["tokens"]), expected[name])


@pytest.mark.parametrize("name", NAMES)
def test_old_checkpoint_resumes_training(tmp_path, name):
    ckpt = str(tmp_path / name)
    shutil.copytree(os.path.join(FIXTURES, name), ckpt)
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 3 --load {ckpt} --eval-iters 0"),
                      world_size=1)
    history = pretrain(args, print_fn=lambda _m: None).history
    assert [h["iteration"] for h in history] == [3]  # resumed after iteration 2
    assert torch.isfinite(torch.tensor(history[0]["lm loss"]))
    # Its scheduler state counted iterations (before sample-based training): converted to
    # samples on load, the schedule goes on where a run that never stopped would be.
    straight = pretrain(parse_args(shlex.split(f"{TINY_MOE} --train-iters 3 --eval-iters 0"),
                                   world_size=1), print_fn=lambda _m: None).history
    assert history[0]["lr"] == pytest.approx(straight[2]["lr"], rel=1e-12)


# --- shared experts saved whole, before they were split over TP -------------------------

SHARED_FIXTURES = os.path.join(os.path.dirname(FIXTURES), "checkpoints_shared_v1")
SHARED = "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate"
TP2 = "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer"


def test_old_whole_shared_experts_give_their_recorded_logits():
    """`shared_experts.linear_fc1.weight` [2F, H] was one logical tensor: it loads into the
    gate and up parts the shared experts are saved as now."""
    expected = torch.load(os.path.join(SHARED_FIXTURES, "expected_logits.pt"),
                          weights_only=True)
    model = from_checkpoint(os.path.join(SHARED_FIXTURES, "torch_dist_tp2_shared"))
    with torch.no_grad():
        assert torch.equal(model(expected["tokens"]), expected["torch_dist_tp2_shared"])


def _shared_losses(rank: int, world_size: int, extra: str) -> list[float]:
    args = parse_args(shlex.split(f"{TINY_MOE} {SHARED} --train-iters 4 --eval-iters 0 "
                                  f"{extra}"), world_size=world_size)
    return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


def test_old_whole_shared_experts_resume_under_tp2_and_one_process(tmp_path):
    """The old checkpoint (weights and Adam states of the whole shared experts) resumes
    under TP=2 + SP (each rank reads its slices) and in one process, with the losses of a
    run that never stopped."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(SHARED_FIXTURES, "torch_dist_tp2_shared"), ckpt)
    straight = _shared_losses(0, 1, "")
    one = _shared_losses(0, 1, f"--load {ckpt}")
    two = run_distributed(_shared_losses, 2, 240, f"--load {ckpt} {TP2}")
    for losses in (one, *two):
        assert len(losses) == 2
        for a, b in zip(losses, straight[2:]):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, straight)
