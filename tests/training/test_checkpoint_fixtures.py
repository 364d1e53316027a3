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
