"""Every checkpoint holds the state of the iteration it was saved at, also when it is
written in the background (--async-save) while training goes on (checkpoint/snapshot.py).

The async checkpoints of a run are compared with the blocking checkpoints of the same run
(every field: iteration, consumed samples, optimizer step and moments, scheduler, RNG
states, weights), and a run resumed from *each* of them continues like the run that never
stopped. Same process, same kernels: bitwise is the right comparison.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megamoe.training.checkpoint import (
    PAUSE_ENV,
    iteration_dir,
    read_checkpoint,
    read_common,
    read_dist_tensors,
)
from megamoe.training.checkpoint.publish import PAUSE_SECONDS_ENV
from tests.training.test_crash_resume import _run

# dropout on, so the restored RNG states decide the resumed losses
RUN = "--train-iters 4 --save-interval 1 --hidden-dropout 0.1"


def _same(a, b, where: str = "") -> None:
    """Recursive bitwise equality of two checkpoint states."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _state(path: str, fmt: str) -> dict:
    state = read_checkpoint(path)
    if fmt == "torch_dist":  # common.pt (optimizer step), every tensor (weights, moments)
        state = {**read_common(path), "model": state["model"],
                 "tensors": read_dist_tensors(path)}
    state.pop("_file", None)
    del state["args"]  # (the command lines differ: --save, --async-save)
    return state


@pytest.mark.parametrize("fmt", ["torch_dist", pytest.param("torch", marks=pytest.mark.slow)])
def test_resume_from_every_async_checkpoint_matches_the_straight_run(tmp_path, monkeypatch,
                                                                     fmt):
    f = f"{RUN} --ckpt-format {fmt}"
    sync, bg = tmp_path / "sync", tmp_path / "async"
    straight = _run(f"{f} --save {sync}")
    # iteration 1's write waits (torch: on the writer thread) while iteration 2 trains:
    # whatever it had not copied would be written with iteration 2's values
    monkeypatch.setenv(PAUSE_ENV, f"before_write:1:{tmp_path / 'paused'}")
    monkeypatch.setenv(PAUSE_SECONDS_ENV, "0.5")
    assert _run(f"{f} --async-save --save {bg}") == straight
    monkeypatch.delenv(PAUSE_ENV)
    for k in (1, 2, 3):  # every async checkpoint but the last (written at finalize)
        a, b = _state(iteration_dir(str(sync), k), fmt), _state(iteration_dir(str(bg), k), fmt)
        assert b["iteration"] == k and b["consumed_train_samples"] == 8 * k
        _same(a, b, f"iter {k}")
        resumed = _run(f"{f} --load {iteration_dir(str(bg), k)} --save {tmp_path / str(k)}")
        assert [h["iteration"] for h in resumed] == [k + 1, *range(k + 2, 5)]
        assert resumed == straight[k:], k
