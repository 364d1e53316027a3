"""A save that fails (a full disk: the kernel's own ENOSPC, from /dev/full, injected at one
checkpoint's write by tests/training/inject.py) ends the run on every rank with one line
naming the --save directory and the error, leaves the previous checkpoint and the pointer
as they were and no temporary directory behind, in both formats, blocking and
--async-save (where the failure surfaces at the next save or at the end of training)."""

from __future__ import annotations

import builtins
import errno
import os
import shlex
import subprocess
import sys
from typing import Optional

import pytest
import torch

from megamoe.training.checkpoint import (
    TRACKER,
    CheckpointError,
    publish,
    read_checkpoint,
    read_tracker,
    write_checkpoint,
)
from megamoe.training.run_record import RUN_RECORDS
from tests.distributed import run_distributed
from tests.training.inject import rank_main
from tests.training.test_pretrain import ROOT, TINY_MOE

ENOSPC = "[Errno 28] No space left on device"


def _cli(spec: Optional[str], flags: str) -> subprocess.CompletedProcess:
    """The real pretrain_gpt.py, with the fault `spec` installed (tests/training/inject.py)
    or without one."""
    program = ["-m", "tests.training.inject", spec] if spec else ["pretrain_gpt.py"]
    return subprocess.run([sys.executable, *program, *shlex.split(f"{TINY_MOE} {flags}")],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def _one_line(code: int, err: str, line: str, exact: bool = True) -> None:
    """Exit code 1 and one line on stderr: `line` (`exact`), or starting with it."""
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == line if exact else lines[0].startswith(line), (lines[0], line)


def _only_the_first_checkpoint(save) -> None:
    """The pointer still names iteration 1, which loads; nothing else is left (beside
    the run's records: its resolved configuration and heatmap PNGs)."""
    assert read_tracker(str(save)) == 1
    assert sorted(set(os.listdir(save)) - RUN_RECORDS) == ["iter_0000001", TRACKER]
    assert read_checkpoint(str(save))["iteration"] == 1


# (--train-iters, the last iteration that trains): the save of iteration 2 fails; a
# blocking save stops the run there, a background one at the next save (iteration 3) or
# at the end of training (finalize)
MODES = {"sync": ("", 3, 2), "async-next-save": ("--async-save", 4, 3),
         "async-finalize": ("--async-save", 2, 2)}


@pytest.mark.parametrize("fmt, mode", [  # one case in the default set, the others slow
    ("torch_dist", "sync"),
    pytest.param("torch", "async-next-save", marks=pytest.mark.slow),
    pytest.param("torch_dist", "async-finalize", marks=pytest.mark.slow),
    pytest.param("torch", "sync", marks=pytest.mark.slow),
    pytest.param("torch_dist", "async-next-save", marks=pytest.mark.slow),
    pytest.param("torch", "async-finalize", marks=pytest.mark.slow)])
def test_full_disk_is_one_line_and_keeps_the_last_checkpoint(tmp_path, fmt, mode):
    save = tmp_path / "save"
    extra, iters, last = MODES[mode]
    spec = "enospc-file:2" if fmt == "torch" else "enospc-dist:2:0"
    p = _cli(spec, f"--train-iters {iters} --save-interval 1 --save {save} "
                   f"--ckpt-format {fmt} {extra}")
    _one_line(p.returncode, p.stderr,
              f"pretrain_gpt.py: error: saving checkpoint iteration 2 to {save} failed: "
              f"{ENOSPC}")
    assert f"iteration {last:8d}/" in p.stdout and f"iteration {last + 1:8d}/" not in p.stdout
    _only_the_first_checkpoint(save)
    # and the next save into the same directory works: resume from 1, save 2
    p = _cli(None, f"--train-iters 2 --save-interval 1 --save {save} --load {save} "
                              f"--ckpt-format {fmt} {extra}")
    assert p.returncode == 0, p.stderr
    assert read_tracker(str(save)) == 2 and read_checkpoint(str(save))["iteration"] == 2


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_permission_denied_is_one_line_and_keeps_the_last_checkpoint(tmp_path, fmt):
    save = tmp_path / "save"
    p = _cli("eacces-tmp:2", f"--train-iters 3 --save-interval 1 --save {save} "
                             f"--ckpt-format {fmt}")
    _one_line(p.returncode, p.stderr, f"pretrain_gpt.py: error: saving checkpoint iteration 2 "
                                      f"to {save} failed: [Errno 13] Permission denied: "
                                      f"'{save}/iter_0000002.tmp.", exact=False)
    _only_the_first_checkpoint(save)


class _OneFailingWrite:
    """A file whose first large write fails (ENOSPC) and whose close succeeds: torch.save
    then reports only a short write ("unexpected pos"), unless the error is kept."""

    def __init__(self, path: str) -> None:
        self.f, self.failed = builtins.open(path, "wb"), False

    def write(self, data) -> int:
        if not self.failed and len(memoryview(data)) > 1024:
            self.failed = True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def test_a_write_error_inside_torch_save_keeps_its_errno(tmp_path, monkeypatch):
    model = torch.nn.Linear(64, 64)
    monkeypatch.setattr(publish, "open", lambda path, mode="r", *a, **k: _OneFailingWrite(path)
                        if path.endswith(publish.FILENAME) else builtins.open(path, mode, *a, **k),
                        raising=False)
    with pytest.raises(CheckpointError) as e:
        write_checkpoint(str(tmp_path), 1, {"model": model.state_dict()})
    assert str(e.value) == (f"saving checkpoint iteration 1 to {tmp_path} failed: "
                            f"{ENOSPC}"), e.value
    assert os.listdir(tmp_path) == []


EACCES = "[Errno 13] Permission denied: "


@pytest.mark.parametrize("spec, flags, where, reason", [
    # only rank 1's shard write fails; DCP reports it to every rank
    ("enospc-dist:2:1", "", " on rank 1", ENOSPC),
    pytest.param("enospc-dist:2:1", "--async-save", " on rank 1", ENOSPC,
                 marks=pytest.mark.slow),
    # rank 0 alone: the temporary directory, then common.pt (after every rank's shards)
    pytest.param("eacces-tmp:2", "", " on rank 0", EACCES, marks=pytest.mark.slow),
    pytest.param("enospc-common:2", "", " on rank 0", ENOSPC, marks=pytest.mark.slow),
    # --ckpt-format torch: rank 0 writes alone, rank 1 must not wait for it forever
    ("enospc-file:2", "--ckpt-format torch", "", ENOSPC),
])
def test_two_ranks_end_together_when_one_rank_cannot_write(tmp_path, spec, flags, where,
                                                           reason):
    save = tmp_path / "save"
    out = run_distributed(rank_main, 2, 180, spec,
                          f"{TINY_MOE} --train-iters 2 --save-interval 1 --save {save} "
                          f"{flags}")
    for code, err in out:
        _one_line(code, err, f"pretrain_gpt.py: error: saving checkpoint iteration 2 to "
                             f"{save} failed{where}: {reason}", exact=reason == ENOSPC)
    _only_the_first_checkpoint(save)
