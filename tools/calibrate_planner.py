#!/usr/bin/env python
"""Calibrate the planner's step-time model against published Megatron-Core throughput.

    python tools/calibrate_planner.py [--table tools/planner_calibration.json]

Reads the published rows (tools/planner_calibration.json: per row the GPUs, precision,
GBS / MBS, sequence, TP / PP / VPP / CP / EP / ETP, recompute, the published TFLOP/s/GPU
and step time, and the source), costs EXACTLY each comparable row's layout with the
planner's step-time model (planner.step_time, not the planner's own pick), splits the
comparable rows deterministically (table order: even positions calibrate, odd ones are
held out), fits the model's two efficiency constants (gemm_efficiency, comm_efficiency)
on the calibration half and prints JSON: per row the published and modelled tokens/s/GPU
and TFLOP/s/GPU (before: the guesses 0.6 / 0.7 the planner used until this calibration;
after: the fit), their predicted / published ratio, the planner's current defaults
(megamoe/planning/calibration.py, which should equal the fit), and the held-out ratios
(median, min, max). Rows the model cannot express (FP8, FSDP, CUDA graphs, 1F1B
all-to-all overlap, ...) are listed as not comparable with their reason.

Throughput is compared in tokens/s/GPU: published TFLOP/s use Megatron's FLOP count
(causal attention counted half), megamoe's flops_per_token counts the full score matrix,
so a published TFLOP/s figure is turned into tokens/s with Megatron's count first.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megamoe.cli.arguments import OneLineArgumentParser, config_file_to_argv, parse_args  # noqa: E402
from megamoe.cli.mapping import run_config_from_args  # noqa: E402
from megamoe.config.pipeline_split import PipelineSplit  # noqa: E402
from megamoe.model.flops import attention_core_width, flops_per_token  # noqa: E402
from megamoe.planning.calibration import (  # noqa: E402
    H100_COMM_EFFICIENCY,
    H100_GEMM_EFFICIENCY,
)
from megamoe.planning.calibration_table import TableError, load_table  # noqa: E402
from megamoe.planning.memory import Layout  # noqa: E402
from megamoe.planning.planner import Hardware, step_time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TABLE = os.path.join(ROOT, "tools", "planner_calibration.json")
UNCALIBRATED = (0.6, 0.7)  # the guessed (gemm, comm) efficiencies before this calibration
GRID = [round(0.05 + 0.005 * i, 3) for i in range(191)]  # 0.05 .. 1.0


def load_models(table: dict) -> dict:
    """(model name, sequence length) -> ModelConfig of each comparable row, from its
    preset (as plan_parallel.py loads one) at the row's sequence length."""
    out = {}
    for row in table["rows"]:
        key = (row["model"], row["seq_length"])
        if not row["comparable"] or key in out:
            continue
        entry = table["models"][row["model"]]
        config = os.path.join(ROOT, entry["config"])
        if not os.path.isfile(config):
            raise TableError(f"models.{row['model']}.config: file not found: {entry['config']}")
        seq = str(row["seq_length"])  # (ModelZoo sets --max-position-embeddings to it)
        argv = config_file_to_argv(config) + ["--dry-run", "--seq-length", seq,
                                              "--max-position-embeddings", seq]
        args = parse_args(argv, world_size=1, prog="calibrate_planner.py")
        out[key] = run_config_from_args(args, entry["vocab_size"]).model
    return out


def megatron_flops_per_token(model) -> float:
    """Megatron-LM's num_floating_point_operations per token: megamoe's count with the
    causal attention core halved (QK^T and AV over the lower triangle only)."""
    core = 6 * model.seq_length * attention_core_width(model) * model.num_layers
    return flops_per_token(model) - core / 2


def row_layout(model, row: dict) -> Layout:
    """The row's exact layout. ModelZoo's runs count the embedding and the loss as one
    layer each in the pipeline split (--account-for-embedding/loss-in-pipeline-split)."""
    split = None
    if row["pp"] > 1:
        counts = PipelineSplit(row["pp"], account_for_embedding=True, account_for_loss=True,
                               virtual_stages=row["vpp"]).counts(model.num_layers)
        split = tuple(counts[v % row["pp"]][v // row["pp"]]
                      for v in range(row["pp"] * row["vpp"]))
    dp = row["gpus"] // (row["tp"] * row["pp"] * row["cp"])
    return Layout(row["tp"], row["pp"], row["vpp"], row["ep"], row["etp"], dp, row["cp"],
                  True, row["recompute"], row["micro_batch_size"], split=split)


def step_coefficients(model, row: dict, hw: Hardware) -> tuple[float, float]:
    """(A, B) with step seconds = A / gemm_efficiency + B / comm_efficiency: the model is
    linear in both inverses, so two evaluations give it exactly."""
    lay = row_layout(model, row)

    def total(g: float) -> float:
        h = replace(hw, gemm_efficiency=g, comm_efficiency=1.0)
        return step_time(model, lay, h, row["seq_length"], row["global_batch_size"])["total"]

    t1, t_half = total(1.0), total(0.5)
    return t_half - t1, 2 * t1 - t_half


def published_tokens(model, row: dict) -> float:
    """Published tokens/s/GPU: from the step time where published, else from the
    TFLOP/s/GPU with Megatron's FLOP count."""
    if row.get("step_time_s"):
        return row["global_batch_size"] * row["seq_length"] / row["step_time_s"] / row["gpus"]
    return row["tflops_per_gpu"] * 1e12 / megatron_flops_per_token(model)


def fit(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(gemm, comm) efficiencies on GRID minimising the squared log error of the step time
    over `points` (A, B, published seconds); ties go to the first grid point."""
    best = None
    for g in GRID:
        for c in GRID:
            err = sum(math.log((a / g + b / c) / t) ** 2 for a, b, t in points)
            if best is None or err < best[0] - 1e-15:
                best = (err, g, c)
    return best[1], best[2]


def evaluate(table: dict, models: dict) -> dict:
    """The calibration report (see the module docstring)."""
    comparable, excluded = [], []
    for row in table["rows"]:
        if not row["comparable"]:
            excluded.append({"id": row["id"], "gpu": row["gpu"], "precision": row["precision"],
                             "published_tflops_per_gpu": row["tflops_per_gpu"],
                             "reason": row["reason"]})
            continue
        model = models[(row["model"], row["seq_length"])]
        hw = Hardware(row["gpus"], **table["hardware"][row["gpu"]])
        a, b = step_coefficients(model, row, hw)
        tokens = published_tokens(model, row)
        seconds = row["global_batch_size"] * row["seq_length"] / tokens / row["gpus"]
        comparable.append((row, model, a, b, seconds))
    calib = [c for i, c in enumerate(comparable) if i % 2 == 0]
    gemm, comm = fit([(a, b, t) for _, _, a, b, t in calib])
    rows, held = [], []
    for i, (row, model, a, b, seconds) in enumerate(comparable):
        tok = row["global_batch_size"] * row["seq_length"] / row["gpus"]
        before = tok / (a / UNCALIBRATED[0] + b / UNCALIBRATED[1])
        after = tok / (a / gemm + b / comm)
        mflops = megatron_flops_per_token(model) / 1e12
        ratio = after * seconds / tok
        rows.append({"id": row["id"], "half": "calibration" if i % 2 == 0 else "held_out",
                     "published_tokens_per_s_per_gpu": round(tok / seconds, 1),
                     "layout": (f"{row['gpus']}x{row['gpu']} {row['precision']} GBS "
                                f"{row['global_batch_size']} MBS {row['micro_batch_size']} seq "
                                f"{row['seq_length']} TP{row['tp']} PP{row['pp']} CP{row['cp']}"
                                f" VP{row['vpp']} EP{row['ep']} ETP{row['etp']} recompute "
                                f"{row['recompute']}"),
                     "published_tflops_per_gpu": row["tflops_per_gpu"],
                     "predicted_before_tflops_per_gpu": round(before * mflops, 1),
                     "predicted_after_tflops_per_gpu": round(after * mflops, 1),
                     "ratio_before": round(before * seconds / tok, 3),
                     "ratio_after": round(ratio, 3)})
        if i % 2:
            held.append(ratio)
    return {"fitted": {"gemm_efficiency": gemm, "comm_efficiency": comm},
            "defaults": {"gemm_efficiency": H100_GEMM_EFFICIENCY,
                         "comm_efficiency": H100_COMM_EFFICIENCY},
            "held_out_ratio": {"median": round(statistics.median(held), 3),
                               "min": round(min(held), 3), "max": round(max(held), 3),
                               "rows": len(held)},
            "rows": rows, "not_comparable": excluded}


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(prog="calibrate_planner.py", description=__doc__.split("\n")[0])
    p.add_argument("--table", default=DEFAULT_TABLE, help="published rows (JSON)")
    a = p.parse_args(argv)
    try:
        table = load_table(a.table)
        models = load_models(table)
    except TableError as e:
        print(f"calibrate_planner.py: {a.table}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(evaluate(table, models), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
