"""megamoe.from_checkpoint: the model a checkpoint was saved from, with no command line."""

from __future__ import annotations

import os
import shlex

import pytest
import torch

import megamoe
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.checkpoint import CheckpointError
from tests.training.test_pretrain import TINY_MOE


def test_from_checkpoint_any_path_form_and_dtype(tmp_path):
    save = tmp_path / "run"
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 2 --save {save} "
                                  "--ckpt-format torch"), world_size=1)
    pretrain(args, print_fn=lambda _m: None)
    tokens = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(0))
    model = megamoe.from_checkpoint(str(save))
    assert not model.training
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (3, 16, 97)  # NullTokenizer: 97 ids; padding never shows
    for path in (save / "iter_0000002", save / "iter_0000002" / "model_optim_rng.pt"):
        with torch.no_grad():
            assert torch.equal(megamoe.from_checkpoint(str(path))(tokens), logits)
    bf16 = megamoe.from_checkpoint(str(save), dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16
    # the same weights as the trainer's own checkpoint
    state = torch.load(os.path.join(save, "iter_0000002", "model_optim_rng.pt"),
                       weights_only=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state["model"][k]), k


def test_from_checkpoint_bad_paths(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        megamoe.from_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt: missing"):
        megamoe.from_checkpoint(str(tmp_path))
