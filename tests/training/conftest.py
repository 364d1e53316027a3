"""Fixtures the checkpoint tests share."""

from __future__ import annotations

import pytest

from tests.training.test_pretrain import _run


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """format ("torch", "torch_dist") -> the save directory of a one-iteration tiny MoE
    run (this module's own copy: tests edit copies of it, never it)."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for fmt in ("torch", "torch_dist"):
        out[fmt] = str(root / fmt)
        _run(f"--train-iters 1 --save {out[fmt]} --ckpt-format {fmt}")
    return out
