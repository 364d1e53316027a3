"""A CPU stand-in for NVIDIA Transformer Engine (tests only; never installed).

What it reproduces from TE v2.18 (commit 27486e03cfc1fa41f6932dcecdc47c71c47eac3e):
- every constructor, forward and function megamoe calls accepts exactly the parameters
  recorded in tests/fixtures/te_signatures.json, which tools/te_signatures.py parses out of
  TE's source at that commit: a keyword TE lacks raises TypeError, a required one missing
  too (`checked`);
- module parameter names: Linear `weight`, `bias`; LayerNormLinear `layer_norm_weight`,
  `layer_norm_bias`, `weight`, `bias`; GroupedLinear `weight{i}` (read with getattr at each
  forward, as TE's `_get_weight_tensors`);
- `get_extra_state` / `set_extra_state`: a 1-D uint8 CPU tensor, empty without FP8 state,
  else a pickled dict (TE pickles its FP8 metadata the same way);
- `autocast(enabled, calibrating, recipe, amax_reduction_group)` and the deprecated
  `fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)`.

What it computes: megamoe's fp32 math (F.linear, F.rms_norm / F.layer_norm, per-group
linears, causal SDPA with GQA; DotProductAttention's kv_channels an int or TE's (k, v) pair
with MLA's narrower values, checked against the inputs' head dims as TE's forward
asserts), never FP8. Under an FP8 autocast each module records the
recipe it ran under and, for DelayedScaling, its input amaxes in an amax history of the
recipe's length: the state its extra state round-trips. So tests prove wiring (which
module, which keywords, which parameters, which recipe, what a checkpoint carries), not
TE's kernels: those are checked on a GPU (scripts/gpu_selftest.sh).
"""

from __future__ import annotations

import ast
import json
import os

_FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "fixtures", "te_signatures.json")
with open(_FIXTURE) as _f:
    SIGNATURES = json.load(_f)
COMMIT = SIGNATURES["source"]["commit"]


def _default(param: dict):
    try:
        return ast.literal_eval(param["default"])
    except (ValueError, SyntaxError, KeyError):
        return None


def checked(key: str, args: tuple, kwargs: dict) -> dict:
    """Bind `args`/`kwargs` to TE's recorded signature of `transformer_engine.<key>`, as
    Python would: TypeError for too many positionals, an unknown or repeated keyword, or
    a missing required parameter. Returns {name: value} with the recorded literal
    defaults filled in."""
    sig = SIGNATURES["callables"][f"transformer_engine.{key}"]
    params = [p for p in sig["params"] if p["kind"] not in ("var_positional", "var_keyword")]
    var_kw = any(p["kind"] == "var_keyword" for p in sig["params"])
    positional = [p for p in params if p["kind"] != "keyword_only"]
    if len(args) > len(positional):
        raise TypeError(f"{key}() takes {len(positional)} positional arguments but "
                        f"{len(args)} were given")
    bound = {p["name"]: a for p, a in zip(positional, args)}
    names = {p["name"] for p in params if p["kind"] != "positional_only"}
    for k, v in kwargs.items():
        if k in bound:
            raise TypeError(f"{key}() got multiple values for argument '{k}'")
        if k not in names and not var_kw:
            raise TypeError(f"{key}() got an unexpected keyword argument '{k}' "
                            f"(Transformer Engine {COMMIT[:8]} has no such parameter)")
        bound[k] = v
    missing = [p["name"] for p in params if p["required"] and p["name"] not in bound]
    if missing:
        raise TypeError(f"{key}() missing required arguments: {missing}")
    for p in params:
        if p["name"] not in bound:
            bound[p["name"]] = _default(p)
    return bound
