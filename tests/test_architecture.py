"""The package's shape, checked: imports run one way, nothing hides a cycle, modules and
functions stay small.

Layers, lowest first (docs/ARCHITECTURE.md): a module may import from its own layer and
the ones below, never above, and the import graph, imports inside functions included, has
no cycle. An import inside a function is allowed only for an optional dependency (one that
may be missing, or that is slow to import and used by one code path).
"""

from __future__ import annotations

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megamoe")

LAYERS = [  # lowest first; a module belongs to the first prefix it matches
    ("config", ["megamoe.config"]),
    ("parallel primitives", ["megamoe.parallel"]),
    ("moe", ["megamoe.moe"]),
    ("model", ["megamoe.model"]),
    ("data and planning", ["megamoe.data", "megamoe.planning"]),
    ("parallelize", ["megamoe.parallelize"]),
    ("training", ["megamoe.training"]),
    ("command line and inference", ["megamoe.cli", "megamoe.inference"]),
    ("package API", ["megamoe"]),
]
# Imports allowed inside functions: optional or heavy packages used by one code path.
# (sentencepiece and tokenizers: each serves one tokenizer type, and the data
# preprocessing workers must not pay for the others; nltk: --split-sentences only.)
OPTIONAL = {"transformers", "tensorboard", "torch.utils.tensorboard", "wandb", "matplotlib",
            "grouped_gemm", "transformer_engine", "apex", "deepspeed", "sentencepiece",
            "tokenizers", "pyarrow", "zstandard", "nltk"}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, str]:
    """{dotted name: path} of every module of the package."""
    out = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, module: str, is_package: bool):
    """(imported module name, line, inside a function) for every import statement."""
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = module.split(".")
                    keep = len(parts) - child.level + (1 if is_package else 0)
                    base = ".".join(parts[:keep] + ([base] if base else []))
                out.extend((f"{base}.{a.name}", child.lineno, in_function)
                           for a in child.names)
            visit(child, inner)

    visit(tree, False)
    return out


def _resolve(name: str, modules: dict[str, str]) -> str | None:
    """The package module `name` refers to (longest existing prefix), or None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _graph():
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    local_imports = []
    for m, path in modules.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for name, line, in_function in _imports(tree, m, path.endswith("__init__.py")):
            target = _resolve(name, modules) if name.startswith("megamoe") else None
            if target is not None and target != m:
                edges[m].add(target)
            if in_function and (target is not None or not any(
                    name == o or name.startswith(o + ".") for o in OPTIONAL)):
                local_imports.append(f"{os.path.relpath(path, ROOT)}:{line} imports "
                                     f"{target or name}")
    return modules, edges, sorted(set(local_imports))


def _layer(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    assert best is not None, module
    return best[0]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    _, edges, _ = _graph()
    assert _cycles(edges) == []


def test_imports_run_one_way():
    _, edges, _ = _graph()
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
              for m, targets in sorted(edges.items()) for t in sorted(targets)
              if _layer(t) > _layer(m)]
    assert upward == []


def test_function_local_imports_only_for_optional_dependencies():
    _, _, local = _graph()
    assert local == []


def test_no_module_shadows_the_standard_library():
    shadowing = [m for m in _modules() if m.rpartition(".")[2] in sys.stdlib_module_names]
    assert shadowing == []


def test_files_and_functions_stay_small():
    long_files, long_functions = [], []
    for path in _modules().values():
        text = open(path, encoding="utf-8").read()
        rel = os.path.relpath(path, ROOT)
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert long_files == [] and long_functions == []


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(edges, expected):
    assert _cycles(edges) == expected


def test_function_local_megamoe_imports_are_seen():
    tree = ast.parse("def f():\n    from megamoe.moe.layer import MoELayer\n")
    assert _imports(tree, "megamoe.x", False) == [("megamoe.moe.layer.MoELayer", 2, True)]
