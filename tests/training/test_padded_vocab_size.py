"""--padded-vocab-size with checkpoints: the command line's value is the run's, never
replaced by the --load checkpoint's row count (Megatron's `_set_arg('padded_vocab_size')`
fills it only when unset, under --use-checkpoint-args, as here); a checkpoint with other rows then
fails to load in one line that names the flag."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.checkpoint.safe_load import CheckpointError
from tests.training.test_pretrain import TINY_MOE


def _losses(extra: str) -> list[float]:
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 4 {extra}"), world_size=1)
    return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


def test_padded_vocab_size_is_not_replaced_by_the_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    straight = _losses("--padded-vocab-size 160")  # 97 ids; computed: 128 rows
    _losses(f"--padded-vocab-size 160 --exit-interval 2 --save {ckpt} --save-interval 2")
    assert _losses(f"--padded-vocab-size 160 --load {ckpt}") == straight[2:]
    with pytest.raises(CheckpointError, match="--padded-vocab-size") as err:
        _losses(f"--padded-vocab-size 192 --load {ckpt}")
    assert "padded_vocab_size=160 but this run has 192" in str(err.value)
    # --use-checkpoint-args fills it when the command line left it unset, not otherwise
    for given, rows in (("", 160), ("--padded-vocab-size 192", 192)):
        args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 4 --load {ckpt} "
                                      f"--use-checkpoint-args {given}"), world_size=1)
        assert args.padded_vocab_size == rows
