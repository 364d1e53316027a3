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
from tests.tolerances import ulp_tol
from tests.training.test_pretrain import TINY_MOE

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures",
                        "checkpoints_v1")
NAMES = ("torch_single", "torch_dist_ep2")


# The recorded logits were computed on another CPU: its BLAS and vector kernels round
# differently (measured: up to 7.5e-8 here, logits of scale 0.47). TINY_MOE's longest path
# is about a dozen fp32 ops of short reductions (H = 32), each a few roundings: 64 units
# of fp32 roundoff at the logits' scale (3.6e-6) is ~50x what machines differ by, and a
# wrong load moves the logits by >= 1e-3 (test_fixture_tolerance_catches_a_wrong_load).
RECORDED_ULPS = 64


def _recorded_logits(fixtures: str, name: str) -> tuple[torch.nn.Module, torch.Tensor,
                                                        torch.Tensor]:
    expected = torch.load(os.path.join(fixtures, "expected_logits.pt"), weights_only=True)
    return from_checkpoint(os.path.join(fixtures, name)), expected["tokens"], expected[name]


@pytest.mark.parametrize("name", NAMES)
def test_old_checkpoint_gives_its_recorded_logits(name):
    model, tokens, logits = _recorded_logits(FIXTURES, name)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), logits, **ulp_tol(logits, RECORDED_ULPS))


def _mutations(sd: dict) -> dict:
    """Mistakes a loader could make, each applied to one loaded tensor."""
    fc1, qkv = "decoder.layers.1.mlp.experts.fc1_weight", \
        "decoder.layers.0.self_attention.linear_qkv.weight"
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    return {
        "experts swapped": {fc1: sd[fc1][[1, 0, 2, 3]]},
        "expert dropped": {fc1: torch.cat([sd[fc1][:3], torch.zeros_like(sd[fc1][3:])])},
        "square weight transposed": {proj: sd[proj].t()},
        "q and k halves swapped": {qkv: torch.cat([sd[qkv][32:], sd[qkv][:32]])},
        "norm weight off by 1%": {"decoder.final_layernorm.weight":
                                  sd["decoder.final_layernorm.weight"] * 1.01},
        "router rows swapped": {"decoder.layers.0.mlp.router.weight":
                                sd["decoder.layers.0.mlp.router.weight"][[1, 0, 2, 3]]},
    }


def test_fixture_tolerance_catches_a_wrong_load():
    """The tolerance above is far below the effect of any loading mistake: each mutation of
    one loaded tensor moves the logits by at least 100x the tolerance."""
    model, tokens, logits = _recorded_logits(FIXTURES, "torch_single")
    atol = ulp_tol(logits, RECORDED_ULPS)["atol"]
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for what, change in _mutations(sd).items():
        model.load_state_dict({**sd, **change})
        with torch.no_grad():
            moved = float((model(tokens) - logits).abs().max())
        assert moved > 100 * atol, f"{what}: logits moved {moved:.2e} only"


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
# The fixture was trained when NullTokenizer --vocab-size 97 meant 98 ids with EOD 97; these
# flags give today's NullTokenizer the same ids, so the mock data (and losses) are the same.
OLD_NULL_IDS = "--vocab-size 98 --null-tokenizer-eod-id 97"


def test_old_whole_shared_experts_give_their_recorded_logits():
    """`shared_experts.linear_fc1.weight` [2F, H] was one logical tensor: it loads into the
    gate and up parts the shared experts are saved as now."""
    model, tokens, logits = _recorded_logits(SHARED_FIXTURES, "torch_dist_tp2_shared")
    with torch.no_grad():  # recorded on another CPU: the tolerance of the tests above
        torch.testing.assert_close(model(tokens), logits, **ulp_tol(logits, RECORDED_ULPS))


def _shared_losses(rank: int, world_size: int, extra: str) -> list[float]:
    args = parse_args(shlex.split(f"{TINY_MOE} {SHARED} {OLD_NULL_IDS} --train-iters 4 "
                                  f"--eval-iters 0 {extra}"), world_size=world_size)
    return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


@pytest.mark.slow  # (their logits and one-process resume stay in the default set)
def test_old_whole_shared_experts_resume_under_tp2_and_one_process(tmp_path):
    """The old checkpoint (weights and Adam states of the whole shared experts) resumes
    under TP=2 + SP (each rank reads its slices) and in one process, with the losses of a
    run that never stopped. It was padded to 128 rows (--make-vocab-size-divisible-by
    alone); TP=2 now pads to 256 (x TP, Megatron's rule), so the TP=2 resume keeps the
    checkpoint's 128 rows (training/checkpoint/vocab_padding.py)."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(SHARED_FIXTURES, "torch_dist_tp2_shared"), ckpt)
    straight = _shared_losses(0, 1, "")
    one = _shared_losses(0, 1, f"--load {ckpt}")
    two = run_distributed(_shared_losses, 2, 240, f"--load {ckpt} {TP2}")
    for losses in (one, *two):
        assert len(losses) == 2
        for a, b in zip(losses, straight[2:]):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, straight)
