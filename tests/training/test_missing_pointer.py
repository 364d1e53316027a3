"""--load of a directory whose pointer file is gone: megamoe refuses to start from scratch
over trained checkpoints (Megatron warns and starts from random weights, and
--ckpt-keep-last would then delete the trained iterations; README, deviations), names the
newest complete iter_* and --ckpt-step; --ckpt-step N resumes from iter_N (Megatron's
meaning), and retention never deletes what this run's pointer chain did not write.
--exit-on-missing-checkpoint: Megatron's exit when --load holds no checkpoint."""

from __future__ import annotations

import os
import shlex
import shutil

from megamoe.cli.main import main
from megamoe.training.checkpoint import TRACKER, iteration_dir, list_checkpoints, read_tracker
from tests.training.test_crash_resume import _run, _snapshot_tree
from tests.training.test_pretrain import TINY_MOE

RUN = "--train-iters 7 --save-interval 1"
DATA_LOG = "megamoe.data: "  # index-build progress (megamoe/data/index_cache.py), not errors


def _main(capsys, flags: str) -> tuple[int, list[str]]:
    """main()'s exit code and stderr lines (the data layer's progress lines apart)."""
    capsys.readouterr()
    code = main(shlex.split(f"{TINY_MOE} {flags}"))
    return code, [line for line in capsys.readouterr().err.strip().splitlines()
                  if not line.startswith(DATA_LOG)]


def test_lost_pointer_is_refused_and_ckpt_step_resumes_without_pruning_others(tmp_path,
                                                                              capsys):
    save = str(tmp_path / "ck")
    straight = _run("--train-iters 7")
    _run(f"{RUN} --exit-interval 5 --save {save}")
    for it in (1, 3):
        shutil.rmtree(iteration_dir(save, it))
    os.remove(os.path.join(save, TRACKER))  # iter_2, iter_4, iter_5, no pointer
    before = _snapshot_tree(save)
    code, err = _main(capsys, f"{RUN} --load {save} --save {save} --ckpt-keep-last 1")
    assert code == 1 and len(err) == 1, err
    assert "iter_0000005" in err[0] and "--ckpt-step 5" in err[0] and TRACKER in err[0]
    assert _snapshot_tree(save) == before  # nothing trained, nothing deleted
    code, err = _main(capsys, f"{RUN} --load {save} --save {save} --ckpt-step 3")
    assert code == 1 and len(err) == 1 and "--ckpt-step 3" in err[0], err
    resumed = _run(f"{RUN} --load {save} --save {save} --ckpt-step 5 --ckpt-keep-last 1")
    assert resumed == straight[5:]  # iterations 6 and 7, as the run that never stopped
    assert read_tracker(save) == 7
    assert list_checkpoints(save) == [2, 4, 5, 7]  # 6 (this run's) pruned, not the others


def test_exit_on_missing_checkpoint(tmp_path, capsys):
    save = str(tmp_path / "ck")
    code, err = _main(capsys, f"--train-iters 2 --load {save} --save {save} "
                              "--exit-on-missing-checkpoint")
    assert code == 1 and len(err) == 1, err
    assert f"--load {save}: no checkpoint found" in err[0] and "--exit-on" in err[0]
    assert not os.path.exists(save)  # nothing trained, nothing written
