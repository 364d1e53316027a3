"""tools/calibrate_planner.py: the planner's efficiency constants fitted to published
Megatron-Core throughput (tools/planner_calibration.json), the held-out error in
docs/planner-calibration.md, and the planner's defaults equal to the fit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from megamoe.planning.planner import Hardware, step_time
from tools import calibrate_planner as cal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "planner-calibration.md")


@pytest.fixture(scope="module")
def report():
    """The script's JSON on the committed table (one run for the module: ~5 s)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "calibrate_planner.py")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_defaults_are_the_fit_and_docs_hold_its_numbers(report):
    """The planner's defaults drift from the fit -> fail; the docs' held-out ratios and
    per-row numbers are what the script prints. Tolerance: one unit of the last printed
    digit (the docs hold rounded output; a last-bit float difference on another CPU may
    flip a rounding, nothing more)."""
    hw = Hardware(gpus=8, gpu_memory_gb=80)
    assert (hw.gemm_efficiency, hw.comm_efficiency) == (
        report["fitted"]["gemm_efficiency"], report["fitted"]["comm_efficiency"])
    doc = open(DOC, encoding="utf-8").read()
    held = report["held_out_ratio"]
    m = re.search(r"median ([\d.]+), min ([\d.]+), max ([\d.]+) \((\d+) rows\)", doc)
    assert m, "docs/planner-calibration.md lost its held-out line"
    assert [float(x) for x in m.groups()[:3]] == pytest.approx(
        [held["median"], held["min"], held["max"]], abs=1.1e-3)
    assert int(m.group(4)) == held["rows"] >= 3
    assert f"`gemm_efficiency` {report['fitted']['gemm_efficiency']:g}" in doc
    for row in report["rows"]:
        line = next(x for x in doc.splitlines() if x.startswith(f"| {row['id']} |"))
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[1] == row["half"].replace("_", "-")
        assert [float(c) for c in cells[3:]] == pytest.approx(
            [row["published_tflops_per_gpu"], row["published_tokens_per_s_per_gpu"],
             row["predicted_before_tflops_per_gpu"], row["predicted_after_tflops_per_gpu"],
             row["ratio_before"], row["ratio_after"]], rel=1e-3, abs=1.1e-3)
    not_comparable = {r["id"] for r in report["not_comparable"]}
    assert {"mz-235b-h100-tp2-ep8-fsdp", "br-2604.01-qwen3-235b-h100-fp8"} <= not_comparable
    assert all(f"| {i} |" in doc for i in not_comparable)


def test_fast_fit_equals_the_step_time_model_and_megatrons_flop_count():
    """The fit's A / g + B / c is the planner's step_time itself (at any constants), and
    Megatron's FLOP count turns the published step times into the published TFLOP/s
    (within 2%: the publisher rounds both to 3 significant digits)."""
    table = cal.load_table(cal.DEFAULT_TABLE)
    models = cal.load_models(table)
    timed = [r for r in table["rows"] if r["comparable"] and r.get("step_time_s")]
    assert len(timed) >= 2
    for row in timed:
        model = models[(row["model"], row["seq_length"])]
        hw = Hardware(row["gpus"], **table["hardware"][row["gpu"]], gemm_efficiency=0.37,
                      comm_efficiency=0.81)
        a, b = cal.step_coefficients(model, row, hw)
        want = step_time(model, cal.row_layout(model, row), hw, row["seq_length"],
                         row["global_batch_size"])["total"]
        assert a / 0.37 + b / 0.81 == pytest.approx(want, rel=1e-9)
        tokens = cal.published_tokens(model, row)
        tflops = tokens * cal.megatron_flops_per_token(model) / 1e12
        assert tflops == pytest.approx(row["tflops_per_gpu"], rel=0.02)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["rows"][0].update(tp=0), "rows[0] (mz-235b-h100-tp2-pp8-vp4-ep32).tp must "
     "be a positive integer, got 0"),
    (lambda t: t["rows"][0].update(precision="fp8"), "the step-time model is bf16 only"),
    (lambda t: t["rows"][1].pop("reason"), "needs a reason"),
    (lambda t: t["hardware"]["H100"].update(peak_tflops="989"), "hardware.H100.peak_tflops"),
    (lambda t: t["hardware"]["H100"].update(peak_fp8_tflops=0),
     "hardware.H100.peak_fp8_tflops must be a positive number"),
])
def test_bad_table_is_one_line_exit_1(tmp_path, capsys, edit, message):
    table = json.load(open(cal.DEFAULT_TABLE, encoding="utf-8"))
    edit(table)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    assert cal.main(["--table", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and str(path) in err
    assert cal.main(["--table", str(tmp_path / "missing.json")]) == 1
    assert "cannot read the table" in capsys.readouterr().err


def test_plan_parallel_efficiency_flags_range_checked(capsys):
    from tools.plan_parallel import main
    for flag in ("--gemm-efficiency=0", "--comm-efficiency=1.5", "--peak-tflops=0",
                 "--peak-fp8-tflops=-1"):
        with pytest.raises(SystemExit) as e:
            main(["--config", "configs/tiny.yaml", "--gpus", "8", "--gpu-memory-gb", "80", flag])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flag.split("=")[0] in err
