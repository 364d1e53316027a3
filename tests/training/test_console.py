"""The operator's console on a real tiny run: startup stages as they happen, the first
iterations logged before --log-interval, each line's ETA / peak memory / TFLOP/s / MFU
after Megatron's fields (in Megatron's order), the resolved configuration printed and
saved as YAML that --config reruns, the expert-load heatmap as PNG files, and the dry
run's table or JSON."""

from __future__ import annotations

import json
import re
import resource
import shlex

import numpy as np
import pytest
import yaml

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import main, pretrain
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import to_dict
from megamoe.model.flops import flops_per_token
from megamoe.training.console import StepClock, format_eta, log_early
from megamoe.training.heatmap import LEFT_PX, TOP_PX, heatmap_geometry
from tests.training.test_pretrain import TINY_MOE

MOE = TINY_MOE.replace("--log-interval 1", "--log-interval 2")
PEAK = 0.05  # --peak-tflops: a made-up device peak, so the line has an MFU on a CPU
# Megatron-LM's training_log fields, in its order (those this run prints).
MEGATRON_FIELDS = ["iteration", "consumed samples", "elapsed time per iteration (ms)",
                   "throughput (tokens/s)", "learning rate", "global batch size", "lm loss",
                   "load_balancing_loss", "z_loss", "loss scale", "grad norm",
                   "number of skipped iterations", "number of nan iterations"]
CONSOLE_FIELDS = ["ETA", "peak host RSS (GiB)", "TFLOP/s/GPU", "MFU"]


@pytest.fixture(scope="module")
def console_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("console")
    lines: list[str] = []
    args = parse_args(shlex.split(f"{MOE} --train-iters 4 --save {out / 'ck'} "
                                  f"--peak-tflops {PEAK} --tensorboard-dir {out / 'tb'}"),
                      world_size=1)
    pretrain(args, print_fn=lines.append)
    return out, lines, args


def _fields(line: str) -> dict[str, str]:
    """'name: value' pairs of an iteration line (the timestamp's colons apart)."""
    parts = [p.strip() for p in line.split(" | ") if p.strip() and p.strip() != "|"]
    parts[0] = parts[0].split("] ", 1)[1]  # "[date] iteration  1/ 4"
    out = {}
    for p in parts:
        name, value = (p.split(": ", 1) if ": " in p else p.split(" ", 1))
        out[name] = value.rstrip(" |")
    return out


def _iteration_lines(lines: list[str]) -> list[str]:
    return [ln for ln in lines if "consumed samples:" in ln]


def test_console_fields_on_a_real_run(console_run):
    _, lines, args = console_run
    stages = [ln for ln in lines if ln.startswith("> ")]
    order = ["> model built in", "> number of parameters", "> data indices built in",
             "> resolved configuration saved to", "> first step done: iteration 1 took"]
    at = [next(i for i, s in enumerate(stages) if s.startswith(o)) for o in order]
    assert at == sorted(at), stages
    assert lines.index(stages[at[-1]]) < lines.index(_iteration_lines(lines)[0])
    assert re.match(r"> data indices built in \d+\.\d s: train \d+, valid none, test none",
                    stages[at[2]])
    its = _iteration_lines(lines)
    fields = [_fields(ln) for ln in its]
    # --log-interval 2: iterations 2 and 4; the first 3 iterations: 1 and 3 besides
    assert [int(f["iteration"].split("/")[0]) for f in fields] == [1, 2, 3, 4]
    run = run_config_from_args(args, 97)
    for f in fields:
        assert list(f) == MEGATRON_FIELDS + CONSOLE_FIELDS, list(f)
        tokens_per_s = float(f["throughput (tokens/s)"])
        tflops = float(f["TFLOP/s/GPU"])
        want = flops_per_token(run.model) * tokens_per_s / 1e12
        # both printed to 3 significant digits (each within 0.5 %); tokens/s to 0.1
        assert tflops == pytest.approx(want, rel=5e-3)
        assert float(f["MFU"].rstrip("%")) == pytest.approx(100 * tflops / PEAK, rel=1e-2)
        rss = float(f["peak host RSS (GiB)"])
        assert 0.05 < rss <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 + 0.01
        assert re.fullmatch(r"\d+:\d\d:\d\d", f["ETA"])
    assert fields[-1]["ETA"] == "0:00:00"  # nothing left


def test_first_iterations_off_is_megatrons_console(tmp_path):
    lines: list[str] = []
    args = parse_args(shlex.split(f"{MOE} --train-iters 4 --log-first-iterations 0"),
                      world_size=1)
    pretrain(args, print_fn=lines.append)
    its = [_fields(ln)["iteration"] for ln in _iteration_lines(lines)]
    assert [int(i.split("/")[0]) for i in its] == [2, 4]


def test_resolved_config_reruns_the_same_configuration(console_run):
    out, lines, args = console_run
    path = out / "ck" / "resolved_config.yaml"
    assert f"> resolved configuration saved to {path}" in lines
    assert lines[0].startswith("------------------------ arguments")
    assert any(re.match(r"  num_layers \.+ 2$", ln) for ln in lines)
    saved = yaml.safe_load(path.read_text())
    assert saved["num-layers"] == 2 and saved["peak-tflops"] == PEAK
    again = parse_args(["--config", str(path)], world_size=1)
    assert _configs(again) == _configs(args)


def _configs(args) -> dict:
    d = to_dict(run_config_from_args(args, 97))
    d.pop("command_line")  # the flags as given, not the configuration
    return d


@pytest.mark.slow
def test_resolved_config_round_trip_for_every_sampled_flag(tmp_path, monkeypatch):
    """Each flag the flag audit samples, with its sample value, and each tiny recipe in
    configs/ survive the YAML."""
    from megamoe.cli.arguments import build_parser
    from megamoe.cli.resolved_config import resolved_yaml
    from tests.test_flag_audit import SAMPLES, sample_argv
    from tests.test_tiny_recipes import RECIPES, ROOT

    parser = build_parser()
    cases = [(flag, world, sample_argv(flag, tmp_path))
             for flag, (_, world, _) in sorted(SAMPLES.items())]
    cases += [(name, 1, ["--config", f"{ROOT}/configs/{name}", *shlex.split(
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 97 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-3 --train-iters 10")]) for name in RECIPES]
    for name, world, argv in cases:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        args = parse_args(argv, world_size=world)
        path = tmp_path / "resolved.yaml"
        path.write_text(resolved_yaml(args, parser))
        again = parse_args(["--config", str(path)], world_size=world)
        assert _configs(again) == _configs(args), name


def test_heatmap_png_every_interval(console_run):
    from matplotlib.image import imread

    out, _, _ = console_run
    pngs = sorted((out / "ck" / "expert_load").glob("*.png"))
    assert [p.name for p in pngs] == ["iter_0000002.png", "iter_0000004.png"]
    assert not (out / "tb" / "expert_load").exists()  # --save first
    g = heatmap_geometry(2, 4)  # 2 MoE layers x 4 experts
    images = [imread(str(p)) for p in pngs]
    for img in images:
        assert img.shape[:2] == (g.height, g.width)
    cells = [img[TOP_PX:TOP_PX + g.plot_h, LEFT_PX:LEFT_PX + g.plot_w, :3] for img in images]
    assert not np.array_equal(*cells)  # the shares changed between the intervals


def test_dry_run_prints_a_table_or_json(capsys):
    argv = shlex.split(f"{MOE} --train-iters 1 --dry-run")
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("dry run:")
    row = {ln.split("  ")[1].strip(): ln.rsplit("  ", 1)[1] for ln in table[1:]}
    assert main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["parameters"] == f"{report['parameters']:,}"
    assert row["per-rank weights"] == \
        f"{report['per_rank_memory_bytes']['weights'] / 2**20:,.1f} MiB"  # < 1 GiB
    with pytest.raises(SystemExit) as e:
        parse_args(shlex.split(f"{MOE} --train-iters 1 --json"), world_size=1)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pretrain_gpt.py: error: --json needs --dry-run (it selects the dry "
                   "run's output)"]


def test_eta_from_the_mean_step_after_the_first():
    clock = StepClock(now=100.0)
    assert clock.eta_s(10, now=100.0) is None
    clock.step_done(now=110.0)  # the first step: 10 s (allocation, compilation)
    assert clock.eta_s(9, now=110.0) == pytest.approx(90.0)
    clock.step_done(now=112.0)
    clock.step_done(now=114.0)  # later steps: 2 s each
    assert clock.eta_s(7, now=114.0) == pytest.approx(14.0)
    assert format_eta(3725.4) == "1:02:05" and format_eta(-3) == "0:00:00"
    assert format_eta(2 * 86400 + 3) == "2 days, 0:00:03"


def test_which_iterations_log_early():
    fresh = [i for i in range(1, 9) if log_early(i, i, 3, 2)]
    assert fresh == [1, 3]  # 2 has its --log-interval line
    assert [i for i in range(1, 9) if log_early(i, i, 0, 2)] == []
    assert [i for i in range(1, 9) if log_early(i, i, 5, 100)] == [1, 2, 3, 4, 5]
    resumed = [100 + s for s in range(1, 9) if log_early(s, 100 + s, 3, 10)]
    assert resumed == [101, 102, 103]  # a resumed run's first steps too


def test_a_run_refused_at_setup_writes_nothing_into_save(tmp_path, capsys):
    """--exit-on-missing-checkpoint with an empty --load: the refusal comes before the
    resolved configuration (or anything else) is written."""
    save = tmp_path / "ck"
    argv = shlex.split(f"{MOE} --train-iters 2 --save {save} --load {tmp_path / 'none'} "
                       f"--exit-on-missing-checkpoint")
    assert main(argv) == 1
    assert not save.exists()
