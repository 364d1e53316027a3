"""--record-memory-history / --memory-snapshot-path: recording starts before the model is
built, snapshots go to <stem>_<rank><ext> on the first iteration and every --log-interval,
an out-of-memory error dumps <stem>_oom_rank_<rank><ext>, only on --profile-ranks (as
Megatron's start_memory_history_recording and training_log). The CUDA allocator calls are
recorded through the module's seams on this CPU machine; off CUDA the flag stops the run
in one line, and --dry-run accepts it (a GPU script checked anywhere)."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.main import main
from megamoe.training import memory_history, pretrain
from tests.training.test_pretrain import TINY_MOE


class _Recorder:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def _record_memory_history(self, enabled, **kwargs):
        self.calls.append(("record", enabled, kwargs["trace_alloc_max_entries"],
                           kwargs["trace_alloc_record_context"]))

    def _dump_snapshot(self, path):
        self.calls.append(("dump", path))


@pytest.fixture
def cuda_calls(monkeypatch):
    """The allocator calls a CUDA run would make, in order, with the model build between."""
    calls, observers = [], []
    monkeypatch.setattr(memory_history, "_is_cuda", lambda device: True)
    monkeypatch.setattr(memory_history, "_memory", lambda: _Recorder(calls))
    monkeypatch.setattr(memory_history, "_attach_oom_observer", observers.append)
    build = pretrain.build_model

    def recorded_build(*args, **kwargs):
        calls.append(("build",))
        return build(*args, **kwargs)

    monkeypatch.setattr(pretrain, "build_model", recorded_build)
    return calls, observers


def test_history_recorded_from_before_the_build_and_dumped_at_log_lines(cuda_calls, tmp_path):
    calls, observers = cuda_calls
    snap = tmp_path / "mem" / "snapshot.pickle"
    code = main(shlex.split(f"{TINY_MOE} --train-iters 5 --log-interval 2 --eval-iters 0 "
                            f"--record-memory-history --memory-snapshot-path {snap}"))
    assert code == 0
    dump = ("dump", str(tmp_path / "mem" / "snapshot_0.pickle"))
    # iteration 1 (the first), 2 and 4 (--log-interval 2)
    assert calls == [("record", True, 100_000, True), ("build",), dump, dump, dump], calls
    observers[0](0, 1 << 30, 1 << 30, 0)  # an out-of-memory error on device 0
    assert calls[-1] == ("dump", str(tmp_path / "mem" / "snapshot_oom_rank_0.pickle"))


def test_only_the_profile_ranks_record(cuda_calls, tmp_path):
    calls, _ = cuda_calls
    code = main(shlex.split(f"{TINY_MOE} --train-iters 2 --eval-iters 0 --profile-ranks 1 "
                            f"--record-memory-history --memory-snapshot-path "
                            f"{tmp_path / 's.pickle'}"))
    assert code == 0 and calls == [("build",)], calls


def test_off_cuda_one_line_and_dry_run_accepts(capsys, tmp_path):
    code = main(shlex.split(f"{TINY_MOE} --train-iters 1 --record-memory-history "
                            f"--memory-snapshot-path {tmp_path / 's.pickle'}"))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()
           and not ln.startswith("megamoe.data: ")]
    assert code == 2 and len(err) == 1 and "--record-memory-history" in err[0], err
    assert "Traceback" not in "\n".join(err)
    assert main(shlex.split(f"{TINY_MOE} --record-memory-history --dry-run")) == 0
    with pytest.raises(SystemExit) as e:
        main(shlex.split(f"{TINY_MOE} --memory-snapshot-path ' ' --dry-run"))
    assert e.value.code == 2
