"""Checkpoints: round trip, atomic publish, a crash mid-save, damaged or foreign files."""

from __future__ import annotations

import os

import pytest
import torch

from megamoe.config import OptimizerConfig
from megamoe.training.checkpoint import (
    TRACKER,
    CheckpointError,
    iteration_dir,
    load_checkpoint,
    save_checkpoint,
)
from megamoe.training.optim import build_optimizer
from megamoe.training.schedules.lr import LRScheduler


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


def test_keep_last_n_retention(tmp_path):
    from megamoe.training.checkpoint import list_checkpoints

    model, opt, sched = _setup()
    for it in range(1, 6):
        save_checkpoint(str(tmp_path), it, model, opt, sched, 8 * it, {}, keep_last=2)
        assert list_checkpoints(str(tmp_path)) == list(range(max(1, it - 1), it + 1))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", "iter_0000005", TRACKER]


def test_retention_never_deletes_the_checkpoint_the_pointer_names(tmp_path):
    """Newer complete directories the pointer chain does not reach (written into another
    root and moved in, or published by a save killed before the pointer moved): iter 3,
    the pointer's, is kept by keep-last 1, and so is every directory outside the chain."""
    from megamoe.training.checkpoint import list_checkpoints, prune_checkpoints

    model, opt, sched = _setup()
    for it in (1, 2, 3):
        save_checkpoint(str(tmp_path), it, model, opt, sched, 8, {})
    for it in (4, 5):
        save_checkpoint(str(tmp_path / "other"), it, model, opt, sched, 8, {})
        os.replace(iteration_dir(str(tmp_path / "other"), it), iteration_dir(str(tmp_path), it))
    assert prune_checkpoints(str(tmp_path), keep_last=1) == [1, 2]
    assert list_checkpoints(str(tmp_path)) == [3, 4, 5]
    assert load_checkpoint(str(tmp_path), *_setup(seed=2)) == (3, 8)


def test_interrupted_resave_falls_back_to_the_old_copy(tmp_path):
    """Killed between `iter_N -> iter_N.old.PID` and `tmp -> iter_N`: the pointer's N is
    missing; readers use the .old copy and the next save restores it."""
    model, opt, sched = _setup()
    save_checkpoint(str(tmp_path), 2, model, opt, sched, 16, {})
    os.replace(iteration_dir(str(tmp_path), 2), iteration_dir(str(tmp_path), 2) + ".old.77")
    os.makedirs(iteration_dir(str(tmp_path), 3) + ".tmp.77")  # the half-written new save
    model2, opt2, sched2 = _setup(seed=6)
    assert load_checkpoint(str(tmp_path), model2, opt2, sched2) == (2, 16)
    assert torch.equal(model2.weight, model.weight)
    save_checkpoint(str(tmp_path), 3, model, opt, sched, 24, {})
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", TRACKER]


def test_async_save_writes_a_snapshot_and_reports_errors(tmp_path):
    from megamoe.training.checkpoint import AsyncCheckpointWriter, build_state

    model, opt, sched = _setup()
    _train(model, opt, sched, 1)
    before = model.weight.detach().clone()
    writer = AsyncCheckpointWriter()
    writer.save(str(tmp_path), 1, build_state(1, model, opt, sched, 8, {}), keep_last=1)
    _train(model, opt, sched, 2)  # training goes on while the thread writes
    writer.save(str(tmp_path), 3, build_state(3, model, opt, sched, 24, {}), keep_last=1)
    after = model.weight.detach().clone()
    _train(model, opt, sched, 1)
    writer.finalize()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", TRACKER]
    model2, opt2, sched2 = _setup(seed=8)
    assert load_checkpoint(str(tmp_path), model2, opt2, sched2) == (3, 24)
    assert torch.equal(model2.weight, after) and not torch.equal(after, before)

    (tmp_path / "file").write_text("x")
    writer.save(str(tmp_path / "file"), 1, build_state(1, model, opt, sched, 8, {}))
    with pytest.raises(CheckpointError, match=r"saving checkpoint iteration 1 to \S+file "
                       r"failed: \[Errno 17\] File exists"):
        writer.finalize()
    writer.finalize()  # reported once


def test_async_save_does_not_block_the_caller(tmp_path, monkeypatch):
    """The caller only pays for the snapshot: a write that cannot finish (held on an event)
    does not delay `save`; `finalize` waits for it."""
    import threading

    from megamoe.training.checkpoint import AsyncCheckpointWriter, build_state
    from megamoe.training.checkpoint import single_file as checkpointing

    release, entered = threading.Event(), threading.Event()
    real_write = checkpointing.write_checkpoint

    def held_write(*a, **k):
        entered.set()
        assert release.wait(30)
        return real_write(*a, **k)

    monkeypatch.setattr(checkpointing, "write_checkpoint", held_write)
    model, opt, sched = _setup()
    writer = AsyncCheckpointWriter()
    writer.save(str(tmp_path), 1, build_state(1, model, opt, sched, 8, {}))
    assert entered.wait(30) and not (tmp_path / TRACKER).exists()  # still writing
    _train(model, opt, sched, 1)  # the training thread is free
    release.set()
    writer.finalize()
    assert (tmp_path / TRACKER).read_text().strip() == "1"


def test_cuda_rng_state_is_saved_and_restored(monkeypatch):
    """On a GPU the CUDA generator's state travels with the checkpoint (a stand-in for
    torch.cuda records what is saved and set)."""
    from megamoe.training.checkpoint import rng_state as rs

    state = {"value": torch.tensor([7], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: state["value"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: state.update(value=s))
    saved = rs.rng_state()
    assert torch.equal(saved["cuda"], torch.tensor([7], dtype=torch.uint8))
    state["value"] = torch.tensor([9], dtype=torch.uint8)
    rs.set_rng_state(saved)
    assert state["value"].tolist() == [7]
