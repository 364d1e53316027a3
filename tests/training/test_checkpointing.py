"""Checkpoints: round trip, atomic publish, a crash mid-save, damaged or foreign files."""

from __future__ import annotations

import os

import pytest
import torch

from megamoe.config import OptimizerConfig
from megamoe.parallel.optimizer import build_optimizer
from megamoe.training.checkpointing import (
    TRACKER,
    CheckpointError,
    iteration_dir,
    load_checkpoint,
    save_checkpoint,
)
from megamoe.training.lr_schedule import LRScheduler


def _setup(seed: int = 0, width: int = 8):
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, 4).to(torch.bfloat16)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    sched = LRScheduler(opt, OptimizerConfig(lr=1e-2, lr_decay_style="cosine"), 10)
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, model.in_features, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        sched.step()


def test_round_trip_restores_model_optimizer_scheduler_rng(tmp_path):
    model, opt, sched = _setup()
    _train(model, opt, sched, 2)
    save_checkpoint(str(tmp_path), 2, model, opt, sched, 16, {"lr": 1e-2})
    _train(model, opt, sched, 2)
    after = [p.detach().clone() for p in model.parameters()]

    model2, opt2, sched2 = _setup(seed=5)
    assert load_checkpoint(str(tmp_path), model2, opt2, sched2) == (2, 16)
    _train(model2, opt2, sched2, 2)  # same RNG draws, same optimizer state -> same result
    for a, b in zip(after, model2.parameters()):
        assert torch.equal(a, b)


def test_no_checkpoint_starts_from_scratch(tmp_path):
    model, opt, sched = _setup()
    assert load_checkpoint(str(tmp_path / "empty"), model, opt, sched) == (0, 0)


def test_crash_mid_save_leaves_previous_checkpoint(tmp_path):
    model, opt, sched = _setup()
    save_checkpoint(str(tmp_path), 1, model, opt, sched, 8, {})
    # a killed save leaves only a temporary directory; the pointer still names iteration 1
    partial = iteration_dir(str(tmp_path), 2) + ".tmp.999"
    os.makedirs(partial)
    open(os.path.join(partial, "model_optim_rng.pt"), "wb").write(b"\x00" * 10)
    assert (tmp_path / TRACKER).read_text().strip() == "1"
    assert load_checkpoint(str(tmp_path), *_setup(seed=3)) == (1, 8)


def test_resave_same_iteration_replaces_it(tmp_path):
    model, opt, sched = _setup()
    save_checkpoint(str(tmp_path), 1, model, opt, sched, 8, {})
    _train(model, opt, sched, 1)
    save_checkpoint(str(tmp_path), 1, model, opt, sched, 8, {})
    model2, opt2, sched2 = _setup(seed=4)
    load_checkpoint(str(tmp_path), model2, opt2, sched2)
    assert torch.equal(model.weight, model2.weight)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", TRACKER]


def test_damaged_file_and_wrong_model_are_clear_errors(tmp_path):
    model, opt, sched = _setup()
    path = save_checkpoint(str(tmp_path), 3, model, opt, sched, 8, {})
    with pytest.raises(CheckpointError, match="does not match the model"):
        load_checkpoint(str(tmp_path), *_setup(width=6))
    open(os.path.join(path, "model_optim_rng.pt"), "wb").write(b"garbage")
    with pytest.raises(CheckpointError, match="model_optim_rng.pt: cannot be read"):
        load_checkpoint(str(tmp_path), *_setup())
    (tmp_path / TRACKER).write_text("latest\n")
    with pytest.raises(CheckpointError, match="expected an iteration number"):
        load_checkpoint(str(tmp_path), *_setup())


def test_finetune_loads_weights_only(tmp_path):
    model, opt, sched = _setup()
    _train(model, opt, sched, 1)
    save_checkpoint(str(tmp_path), 5, model, opt, sched, 40, {})
    model2, opt2, sched2 = _setup(seed=9)
    assert load_checkpoint(str(tmp_path), model2, opt2, sched2, finetune=True) == (0, 0)
    assert torch.equal(model.weight, model2.weight)
    assert torch.equal(opt2.main_params[0], model.weight.float())
