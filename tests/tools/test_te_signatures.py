"""tools/te_signatures.py reads signatures out of source text the way Python binds them
(positional, keyword-only, defaults, *args/**kwargs), dataclass recipes by their init
fields, and the checked-in fixture is its output for TE v2.18."""

from __future__ import annotations

import ast
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import te_signatures  # noqa: E402

SOURCE = '''
class Linear:
    def __init__(self, in_features: int, out_features, bias: bool = True, *args,
                 device="cuda", name=None, **kwargs):
        pass

@dataclass
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    kind: ClassVar[str] = "x"
    hidden: int = field(default=1, init=False)
    amax_history_len: int = 1024
'''


def test_parameters_and_dataclass_fields_as_python_binds_them():
    tree = ast.parse(SOURCE)
    init = te_signatures._methods(te_signatures._find(tree, "Linear"), ("__init__", "forward"))
    params = init["__init__"]["params"]
    assert [(p["name"], p["kind"], p["required"]) for p in params] == [
        ("in_features", "positional_or_keyword", True),
        ("out_features", "positional_or_keyword", True),
        ("bias", "positional_or_keyword", False), ("args", "var_positional", False),
        ("device", "keyword_only", False), ("name", "keyword_only", False),
        ("kwargs", "var_keyword", False)]
    assert params[2]["default"] == "True" and params[4]["default"] == "'cuda'"
    assert init["forward"] is None  # not defined in the class: recorded as absent
    fields = te_signatures._dataclass_fields(te_signatures._find(tree, "DelayedScaling"))
    assert [f["name"] for f in fields] == ["margin", "fp8_format", "amax_history_len"]


def test_fixture_has_every_target():
    with open(os.path.join(ROOT, "tests", "fixtures", "te_signatures.json")) as f:
        data = json.load(f)
    want = {f"transformer_engine.{public}" + ("" if methods is None else f".{m}")
            for public, _, _, methods in te_signatures.TARGETS for m in (methods or [None])}
    want |= {f"transformer_engine.common.recipe.{r}.__init__" for r in te_signatures.RECIPES}
    assert set(data["callables"]) == want
    assert data["enums"]["transformer_engine.common.recipe.Format"] == [
        "E2M1", "E4M3", "E5M2", "HYBRID"]
