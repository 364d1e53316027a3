"""--deterministic-mode with Megatron-LM's meaning (cli/determinism_args.py): Megatron's
three refusals (flash attention, the fused cross entropy, an NCCL_ALGO outside its list)
as one-line errors with exit 2, and torch.use_deterministic_algorithms(True) before the
model is built. scripts/gpu_selftest.sh (DETERMINISTIC=1) checks on GPUs that two runs
then give the same bits."""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli import main as cli_main
from megamoe.cli.arguments import parse_args
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

FLAGS = f"{TINY_MOE} --train-iters 1 --deterministic-mode"


@pytest.fixture
def restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_megatron_refusals_are_one_line(monkeypatch, capsys):
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    assert "NCCL_ALGO must be one of Tree, Ring" in parse_error(capsys, FLAGS, 1)
    monkeypatch.setenv("NCCL_ALGO", "NVLS")  # not reproducible: refused, as Megatron
    assert "got 'NVLS'" in parse_error(capsys, FLAGS, 1)
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    assert "--use-flash-attn" in parse_error(capsys, f"{FLAGS} --use-flash-attn", 1)
    assert "--cross-entropy-loss-fusion" in parse_error(
        capsys, f"{FLAGS} --cross-entropy-loss-fusion", 1)
    assert parse_args(shlex.split(FLAGS), world_size=1).deterministic_mode
    assert not parse_args(shlex.split(f"{TINY_MOE} --train-iters 1"),
                          world_size=1).deterministic_mode


def test_training_runs_with_deterministic_algorithms(monkeypatch, restore_determinism):
    """The mode is on when training starts (so a kernel without a deterministic version
    raises instead of silently differing), and only with the flag."""
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    seen = []
    monkeypatch.setattr(cli_main.training, "pretrain", lambda *a, **k: seen.append(
        torch.are_deterministic_algorithms_enabled()))
    torch.use_deterministic_algorithms(False)
    cli_main.pretrain(parse_args(shlex.split(f"{TINY_MOE} --train-iters 1"), world_size=1))
    cli_main.pretrain(parse_args(shlex.split(FLAGS), world_size=1))
    assert seen == [False, True]
