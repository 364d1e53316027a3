"""Deterministic faults for end-to-end tests of pretrain_gpt.py.

    nan-loss:STEP:RANK      the final norm's output is NaN on RANK during training step
                            STEP (counted from 1 in this process): the loss and every
                            gradient behind it are NaN there
    inf-grad:STEP:RANK      every parameter's gradient is +Inf on RANK during step STEP
                            (leaf gradients: Inf, no NaN); the loss stays finite
    enospc-file:ITER        --ckpt-format torch: the write of iteration ITER's
                            model_optim_rng.pt goes to /dev/full (the kernel's ENOSPC)
    enospc-dist:ITER:RANK   torch_dist: RANK's *.distcp writes of iteration ITER go to
                            /dev/full
    enospc-common:ITER      torch_dist: rank 0's common.pt of iteration ITER goes to
                            /dev/full
    eacces-tmp:ITER         making iteration ITER's temporary directory fails with EACCES
                            (as in a --save directory this user may not write to)

`install(spec, setattr)` installs one (`setattr`: pytest's monkeypatch.setattr, or the
builtin one in a child process). As a program it runs the real pretrain_gpt.py with faults
installed, so the test sees exactly what a user would:

    python -m tests.training.inject SPEC[,SPEC...] FLAGS...
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import runpy
import shlex
import sys
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem

from megamoe.cli.main import main
from megamoe.training import loop, pretrain
from megamoe.training.checkpoint import publish

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SetAttr = Callable[..., None]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def poison(model: torch.nn.Module, kind: str, active: Callable[[], bool]) -> None:
    """While `active()` (and training): "nan-loss" makes the final norm's output NaN (on
    the stage that has it), "inf-grad" every parameter's gradient +Inf."""
    if kind == "nan-loss":
        for name, module in model.named_modules():
            if name.endswith("final_layernorm"):
                module.register_forward_hook(lambda m, args, out: out * float("nan")
                                             if active() and m.training else None)
        return
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(lambda g: torch.full_like(g, float("inf")) if active() else None)


def _poison(kind: str, step: int, rank: int, setattr_: SetAttr) -> None:
    calls = {"n": 0, "active": False}
    forward_backward, build_model = loop.forward_backward, pretrain.build_model

    def counted(model, data_iter, n, *, forward_only=False, **kwargs):
        if forward_only:
            return forward_backward(model, data_iter, n, forward_only=True, **kwargs)
        calls["n"] += 1
        calls["active"] = calls["n"] == step
        try:
            return forward_backward(model, data_iter, n, **kwargs)
        finally:
            calls["active"] = False

    def build(run, mesh=None):
        model = build_model(run, mesh)
        if (mesh.rank if mesh is not None else 0) == rank:
            poison(model, kind, lambda: calls["active"])
        return model

    setattr_(loop, "forward_backward", counted)
    setattr_(pretrain, "build_model", build)


def _full_disk_file(iteration: int, name: str, setattr_: SetAttr) -> None:
    """publish.save_torch_file's open() of `name` in iteration's tmp dir -> /dev/full."""
    tag = f"iter_{iteration:07d}.tmp."

    def fake_open(path, mode="r", *args, **kwargs):
        if "w" in mode and os.path.basename(path) == name and tag in str(path):
            return builtins.open("/dev/full", mode)
        return builtins.open(path, mode, *args, **kwargs)

    setattr_(publish, "open", fake_open, raising=False)


def _full_disk_dist(iteration: int, rank: int, setattr_: SetAttr) -> None:
    """DCP's shard streams of iteration's tmp dir on `rank` -> /dev/full."""
    tag = f"iter_{iteration:07d}.tmp."
    create_stream = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def fake(self, path, mode):
        if "w" in mode and str(path).endswith(".distcp") and tag in str(path) \
                and _rank() == rank:
            with open("/dev/full", mode) as f:
                yield f
        else:
            with create_stream(self, path, mode) as f:
                yield f

    setattr_(filesystem.FileSystem, "create_stream", fake)


def _no_permission(iteration: int, setattr_: SetAttr) -> None:
    tag = f"iter_{iteration:07d}.tmp."
    makedirs = os.makedirs

    def fake(path, *args, **kwargs):
        if tag in os.path.basename(str(path)):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return makedirs(path, *args, **kwargs)

    setattr_(os, "makedirs", fake)


def install(spec: str, setattr_: SetAttr) -> None:
    kind, *nums = spec.split(":")
    values = [int(v) for v in nums]
    if kind in ("nan-loss", "inf-grad"):
        _poison(kind, values[0], values[1], setattr_)
    elif kind == "enospc-file":
        _full_disk_file(values[0], publish.FILENAME, setattr_)
    elif kind == "enospc-common":
        _full_disk_file(values[0], publish.COMMON, setattr_)
    elif kind == "enospc-dist":
        _full_disk_dist(values[0], values[1], setattr_)
    elif kind == "eacces-tmp":
        _no_permission(values[0], setattr_)
    else:
        raise ValueError(f"unknown fault {spec!r}")


def _plain_setattr(obj, name, value, raising=True) -> None:
    setattr(obj, name, value)


if __name__ == "__main__":
    for one in sys.argv[1].split(","):
        install(one, _plain_setattr)
    sys.argv = [os.path.join(ROOT, "pretrain_gpt.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


def rank_main(rank: int, world_size: int, spec: str, argv: str) -> tuple[int, str]:
    """One rank of a tests.distributed.run_distributed test: pretrain_gpt.py's main with
    the fault `spec` installed; (exit code, what it wrote to stderr)."""
    install(spec, lambda obj, name, value, raising=True: setattr(obj, name, value))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(shlex.split(argv))
    return code, err.getvalue()
