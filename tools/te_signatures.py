"""Generate tests/fixtures/te_signatures.json: the constructor and forward signatures of the
Transformer Engine (TE) classes and functions megamoe's TE path calls, read from TE's own
Python source at one pinned commit by parsing it (ast), never by importing it (TE's torch
extension cannot be built without CUDA).

The tests' stand-in `transformer_engine` package (tests/te_stand_in.py) accepts exactly the
keywords recorded here, so a keyword megamoe passes that TE at this commit lacks fails a
test on a machine without TE.

Usage (with a git directory of NVIDIA/TransformerEngine, e.g. from `git clone`):

    python tools/te_signatures.py --git-dir TE/.git --rev v2.18 \
        --out tests/fixtures/te_signatures.json
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys

# (public name, source file, class or function name, methods to record)
TARGETS = [
    ("pytorch.Linear", "transformer_engine/pytorch/module/linear.py", "Linear",
     ("__init__", "forward")),
    ("pytorch.LayerNormLinear", "transformer_engine/pytorch/module/layernorm_linear.py",
     "LayerNormLinear", ("__init__", "forward")),
    ("pytorch.LayerNormMLP", "transformer_engine/pytorch/module/layernorm_mlp.py",
     "LayerNormMLP", ("__init__", "forward")),
    ("pytorch.GroupedLinear", "transformer_engine/pytorch/module/grouped_linear.py",
     "GroupedLinear", ("__init__", "forward")),
    ("pytorch.DotProductAttention",
     "transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py",
     "DotProductAttention", ("__init__", "forward")),
    ("pytorch.RMSNorm", "transformer_engine/pytorch/module/rmsnorm.py", "RMSNorm",
     ("__init__",)),
    ("pytorch.LayerNorm", "transformer_engine/pytorch/module/layernorm.py", "LayerNorm",
     ("__init__",)),
    ("pytorch.fp8_autocast", "transformer_engine/pytorch/quantization.py", "fp8_autocast",
     None),
    ("pytorch.autocast", "transformer_engine/pytorch/quantization.py", "autocast",
     ("__init__",)),
]
RECIPE_FILE = "transformer_engine/common/recipe/__init__.py"
RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling")


def _git_show(git_dir: str, rev: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, "show", f"{rev}:{path}"],
                          check=True, capture_output=True, text=True).stdout


def _params(fn: ast.FunctionDef) -> list[dict]:
    """Every parameter but self: name, kind, whether it has a default (and its source)."""
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        if i == 0 and arg.arg in ("self", "cls"):
            continue
        kind = "positional_only" if arg in a.posonlyargs else "positional_or_keyword"
        out.append(_param(arg.arg, kind, default))
    if a.vararg is not None:
        out.append({"name": a.vararg.arg, "kind": "var_positional", "required": False})
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(_param(arg.arg, "keyword_only", default))
    if a.kwarg is not None:
        out.append({"name": a.kwarg.arg, "kind": "var_keyword", "required": False})
    return out


def _param(name: str, kind: str, default) -> dict:
    entry = {"name": name, "kind": kind, "required": default is None}
    if default is not None:
        entry["default"] = ast.unparse(default)
    return entry


def _find(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return node
    raise SystemExit(f"te_signatures: {name} not found at module level")


def _methods(cls: ast.ClassDef, names) -> dict:
    found = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    return {m: ({"params": _params(found[m])} if m in found else None) for m in names}


def _dataclass_fields(cls: ast.ClassDef) -> list[dict]:
    """A dataclass's constructor: its annotated fields in order (ClassVar and
    field(init=False) excluded)."""
    out = []
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        if "ClassVar" in ast.unparse(node.annotation):
            continue
        value = node.value
        if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field") and any(
                k.arg == "init" and ast.unparse(k.value) == "False" for k in value.keywords):
            continue
        out.append({"name": node.target.id, "kind": "positional_or_keyword",
                    "required": value is None,
                    **({"default": ast.unparse(value)} if value is not None else {})})
    return out


def _enum_members(cls: ast.ClassDef) -> list[str]:
    return [t.id for node in cls.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)]


def generate(git_dir: str, rev: str) -> dict:
    commit = subprocess.run(["git", "--git-dir", git_dir, "rev-parse", f"{rev}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    out = {"source": {"repository": "NVIDIA/TransformerEngine", "rev": rev, "commit": commit,
                      "generator": "tools/te_signatures.py"},
           "callables": {}}
    trees: dict[str, ast.Module] = {}
    for public, path, name, methods in TARGETS:
        tree = trees.setdefault(path, ast.parse(_git_show(git_dir, commit, path)))
        node = _find(tree, name)
        if methods is None:
            out["callables"][f"transformer_engine.{public}"] = {"params": _params(node)}
        else:
            for method, sig in _methods(node, methods).items():
                out["callables"][f"transformer_engine.{public}.{method}"] = sig
    recipe_tree = ast.parse(_git_show(git_dir, commit, RECIPE_FILE))
    for name in RECIPES:
        out["callables"][f"transformer_engine.common.recipe.{name}.__init__"] = {
            "params": _dataclass_fields(_find(recipe_tree, name))}
    out["enums"] = {"transformer_engine.common.recipe.Format":
                    _enum_members(_find(recipe_tree, "Format"))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--git-dir", required=True)
    p.add_argument("--rev", required=True, help="a tag or commit of TransformerEngine")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        data = generate(args.git_dir, args.rev)
    except subprocess.CalledProcessError as e:
        sys.stderr.write(f"te_signatures: error: git failed: {e.stderr.strip()}\n")
        return 1
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
