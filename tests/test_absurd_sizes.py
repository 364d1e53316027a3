"""Absurd sizes end in one line before anything is allocated (issue 26): integer flags
past int64, expressions for --moe-layer-freq that are not 0/1 lists, a --config that is
not a UTF-8 file, and shapes whose memory estimate exceeds the rank's memory by more than
the memory model's stated error (training runs only: --dry-run sizes any layout)."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import main
from megamoe.cli.mapping import run_config_from_args
from megamoe.cli.rules import ArgumentError, parse_layer_freq
from megamoe.planning.dry_run import per_rank_memory
from megamoe.planning.fits import MARGIN, DoesNotFit, check_fits
from tests.training.test_pretrain import TINY_MOE


def _one_line_exit(capsys, argv: list[str], code: int = 2) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=1)
    assert e.value.code == code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("flag", ["--train-iters", "--seq-length", "--micro-batch-size"])
def test_integer_flags_past_int64_are_one_line(capsys, flag):
    argv = shlex.split(TINY_MOE) + [flag, str(10**26)]
    assert f"{flag} must be below 2**63" in _one_line_exit(capsys, argv)


@pytest.mark.parametrize("spec,message", [
    ("[1]*[1]", "cannot read"), ("[1]+1", "cannot read"), ("1+[1]", "cannot read"),
    ("[1]*1.5", "cannot read"), ("[True]*2", "cannot read"), ("__import__('os')", "cannot read"),
    ("[1]*100000000000", "has 100000000000 entries but --num-layers is 2"),
])
def test_moe_layer_freq_expressions_are_one_line(spec, message):
    with pytest.raises(ArgumentError, match="--moe-layer-freq") as e:
        parse_layer_freq(spec, 2)
    assert message in str(e.value)


def test_moe_layer_freq_still_reads_megatron_patterns():
    assert parse_layer_freq("([0]+[1]*3)", 4) == [0, 1, 1, 1]
    assert parse_layer_freq("[1,0]*2", 4) == parse_layer_freq("2*[1,0]", 4) == [1, 0, 1, 0]
    assert parse_layer_freq("2", 4) == [1, 0, 1, 0]


def test_config_that_is_a_directory_or_not_utf8_is_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00num-layers: 2")
    assert "is a directory" in _one_line_exit(capsys, ["--config", str(tmp_path)])
    assert "is not UTF-8 text" in _one_line_exit(capsys, ["--config", str(bad)])


def _run(extra: str):
    return run_config_from_args(parse_args(shlex.split(f"{TINY_MOE} {extra}"), world_size=1),
                                98)


def test_a_rank_that_cannot_fit_is_refused_within_the_margin_warned():
    run = _run("--train-iters 2")
    need = per_rank_memory(run)[0]["total"]
    warnings: list[str] = []
    check_fits(run, warnings.append, memory=(need, "test memory"))  # exactly fits
    assert warnings == []
    check_fits(run, warnings.append, memory=(int(need / (1 + MARGIN)) + 1, "test memory"))
    assert len(warnings) == 1 and "may run out of memory" in warnings[0]
    with pytest.raises(DoesNotFit, match="one rank needs about .* but test memory is"):
        check_fits(run, warnings.append, memory=(int(need / (1 + MARGIN)) - 1, "test memory"))


def test_sample_count_beyond_the_host_is_refused():
    run = _run("--train-iters 1000")  # 1000 x global batch 8 samples x 16 bytes
    check_fits(run, memory=(2**40, "m"), host_bytes=8000 * 16)
    with pytest.raises(DoesNotFit, match="--train-iters/--train-samples ask for 8,000"):
        check_fits(run, memory=(2**40, "m"), host_bytes=8000 * 16 - 1)


@pytest.mark.parametrize("extra", ["--train-iters 2 --micro-batch-size 100000000000000 "
                                   "--global-batch-size 100000000000000",
                                   "--train-iters 2 --seq-length 100000000000 "
                                   "--max-position-embeddings 100000000000",
                                   "--train-iters 1000000000000000000"])
def test_training_run_with_absurd_shapes_exits_2_before_allocating(capsys, extra, tmp_path):
    code = main(shlex.split(f"{TINY_MOE} {extra}") + ["--save", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pretrain_gpt.py: error:" in err[0], err
    assert not (tmp_path / "ckpt").exists()  # nothing written


# --- logging targets: checked on every rank before training ---------------------------

def _main_error(capsys, extra: str, tmp_path) -> tuple[int, list[str]]:
    code = main(shlex.split(f"{TINY_MOE} --train-iters 1 {extra}")
                + ["--save", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert not (tmp_path / "ckpt").exists()  # nothing written
    return code, err


def test_unwritable_tensorboard_and_wandb_dirs_are_one_line(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for extra, flag in ((f"--tensorboard-dir {afile}/tb", "--tensorboard-dir"),
                        (f"--wandb-project p --wandb-save-dir {afile}/w", "--wandb-save-dir"),
                        ("--tensorboard-dir /dev/full/tb", "--tensorboard-dir")):
        code, err = _main_error(capsys, extra, tmp_path)
        assert code == 1 and len(err) == 1 and f"{flag}: cannot write to" in err[0], err


def test_full_disk_is_one_line(capsys, tmp_path, monkeypatch):
    """ENOSPC from the probe's write (a full disk lets a directory be made, not filled)."""
    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("megamoe.training.log_targets.os.fsync", full)
    code, err = _main_error(capsys, f"--tensorboard-dir {tmp_path}/tb", tmp_path)
    assert code == 1 and err == [f"pretrain_gpt.py: error: --tensorboard-dir: cannot write to "
                                 f"{tmp_path}/tb (No space left on device)"]


def test_missing_tensorboard_package_is_one_line(capsys, tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    code, err = _main_error(capsys, f"--tensorboard-dir {tmp_path}/tb", tmp_path)
    assert code == 1 and err == ["pretrain_gpt.py: error: --tensorboard-dir needs the "
                                 "tensorboard package: pip install -e .[logging]"]


@pytest.mark.parametrize("extra,message", [
    (f"--num-layers {2**31}", "--num-layers must be at most 65536"),
    (f"--mtp-num-layers {2**31}", "--mtp-num-layers must be at most 65536"),
    (f"--hidden-size {2**31}", "parameters: more than a tensor can index"),
])
def test_dry_run_of_an_absurd_model_is_one_line(capsys, extra, message):
    try:  # the argument rules exit 2 themselves; the dry run's own checks return 2
        code = main(shlex.split(f"{TINY_MOE} --train-iters 2 {extra} --dry-run"))
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
