"""The published-throughput table tools/calibrate_planner.py reads, checked field by field.

The table is data from outside (copied from published pages), so every field is checked
for type and range before the step-time model sees it: a wrong field is one line naming
the row and the field, never a traceback.
"""

from __future__ import annotations

import json

INT_FIELDS = ("gpus", "seq_length", "global_batch_size", "micro_batch_size", "tp", "pp",
              "vpp", "cp", "ep", "etp")
STR_FIELDS = ("id", "source", "model", "gpu", "precision", "recompute")
HARDWARE_FIELDS = ("gpu_memory_gb", "gpus_per_node", "intra_node_gbps", "inter_node_gbps",
                   "peak_tflops", "peak_fp8_tflops")
# null where the GPU has no FP8 tensor cores (planning/gpu_peaks.py)
NULLABLE_HARDWARE_FIELDS = ("peak_fp8_tflops",)


class TableError(ValueError):
    """A field of the calibration table is missing, of the wrong type or out of range."""


def _positive(value, what: str, kind=(int, float)) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise TableError(f"{what} must be a positive {'integer' if kind is int else 'number'}"
                         f", got {value!r}")


def _check_row(row, i: int, table: dict) -> None:
    if not isinstance(row, dict):
        raise TableError(f"rows[{i}] must be an object")
    where = f"rows[{i}] ({row.get('id', '?')})"
    for name in STR_FIELDS:
        if not isinstance(row.get(name), str) or not row[name]:
            raise TableError(f"{where}.{name} must be a non-empty string")
    for name in INT_FIELDS:
        _positive(row.get(name), f"{where}.{name}", int)
    _positive(row.get("tflops_per_gpu"), f"{where}.tflops_per_gpu")
    if row.get("step_time_s") is not None:
        _positive(row["step_time_s"], f"{where}.step_time_s")
    if not isinstance(row.get("comparable"), bool):
        raise TableError(f"{where}.comparable must be true or false")
    if not row["comparable"]:
        if not isinstance(row.get("reason"), str) or not row["reason"]:
            raise TableError(f"{where}.reason: a row that is not comparable needs a reason")
        return
    if row["precision"] != "bf16":
        raise TableError(f"{where}.precision: the step-time model is bf16 only, got "
                         f"{row['precision']!r} (mark the row not comparable)")
    for key, section in (("model", "models"), ("gpu", "hardware"), ("source", "sources")):
        if row[key] not in table[section]:
            raise TableError(f"{where}.{key}: {row[key]!r} is not in {section}")
    if row["gpus"] % (row["tp"] * row["pp"] * row["cp"]):
        raise TableError(f"{where}: gpus ({row['gpus']}) is not divisible by tp x pp x cp")


def load_table(path: str) -> dict:
    """The table at `path`, every field checked (TableError names the first bad one)."""
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TableError(f"cannot read the table: {e}") from None
    if not isinstance(table, dict):
        raise TableError("the table must be a JSON object")
    for section in ("sources", "hardware", "models"):
        if not isinstance(table.get(section), dict) or not table[section]:
            raise TableError(f"{section} must be a non-empty object")
    for gpu, hw in table["hardware"].items():
        if not isinstance(hw, dict) or set(hw) != set(HARDWARE_FIELDS):
            raise TableError(f"hardware.{gpu} must have exactly {', '.join(HARDWARE_FIELDS)}")
        for name in HARDWARE_FIELDS:
            if hw[name] is not None or name not in NULLABLE_HARDWARE_FIELDS:
                _positive(hw[name], f"hardware.{gpu}.{name}")
    for name, m in table["models"].items():
        if not isinstance(m, dict) or not isinstance(m.get("config"), str):
            raise TableError(f"models.{name}.config must be a path string")
        _positive(m.get("vocab_size"), f"models.{name}.vocab_size", int)
    if not isinstance(table.get("rows"), list) or not table["rows"]:
        raise TableError("rows must be a non-empty list")
    for i, row in enumerate(table["rows"]):
        _check_row(row, i, table)
    if sum(r["comparable"] for r in table["rows"]) < 2:
        raise TableError("at least two comparable rows are needed (one to fit, one held out)")
    return table
