"""Device lint: every tensor the code makes lives on a known device.

On a GPU, a tensor factory without `device=` makes a CPU tensor; fed to a NCCL collective
or mixed with the model's tensors it fails (or, worse, silently copies). gloo accepts CPU
tensors, so no CPU test would notice. The rule, checked on every module of megamoe/:
each call of a torch tensor factory (and of torch.Generator) outside module construction
(`__init__` of an nn.Module subclass: parameters and buffers follow the device the model
is built on, meta included, and materialisation moves them) passes `device=`; the
`__init__` of any other class runs at run time, on the run's device, and is checked like
any function. `device="cpu"` is allowed only for host metadata that never meets a device
tensor or a collective, with a comment on the same or the line before saying so; the same
holds for `x.new_*(...)` and `torch.*_like(...)` given a device (without one they take
their source's, which is right).
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
             "randperm", "linspace", "eye", "empty_strided", "as_tensor", "Generator"}


def _is_factory(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr in FACTORIES
            and isinstance(f.value, ast.Name) and f.value.id == "torch")


def _is_derived(node: ast.Call) -> bool:
    """x.new_*(...) or torch.*_like(...): the device of their source unless given one."""
    f = node.func
    return isinstance(f, ast.Attribute) and (
        f.attr.startswith("new_") or (f.attr.endswith("_like") and isinstance(f.value, ast.Name)
                                      and f.value.id == "torch"))


def _is_cpu(value: ast.AST) -> bool:
    text = ast.unparse(value)
    return text in ("'cpu'", '"cpu"', "torch.device('cpu')", 'torch.device("cpu")')


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [ast.unparse(b) for b in cls.bases]


def module_classes(trees: list[ast.AST]) -> set[str]:
    """Names of the classes that are nn.Module subclasses: a base from torch.nn (other
    than Parameter), or a class already found (to a fixed point, across files)."""
    classes = [c for t in trees for c in ast.walk(t) if isinstance(c, ast.ClassDef)]
    found: set[str] = set()
    while True:
        more = {c.name for c in classes if c.name not in found and any(
            (b.startswith(("nn.", "torch.nn.")) and not b.endswith("Parameter"))
            or b.split(".")[-1] in found for b in _base_names(c))}
        if not more:
            return found
        found |= more


def violations(source: str, path: str, modules: set[str] | None = None,
               tree: ast.AST | None = None) -> list[str]:
    tree = ast.parse(source) if tree is None else tree
    modules = module_classes([tree]) if modules is None else modules
    lines = source.splitlines()
    out = []

    def check(call: ast.Call, device, what: str) -> None:
        where = f"{path}:{call.lineno} {what}"
        if device is None:
            out.append(f"{where}: no device=")
        elif _is_cpu(device):
            near = " ".join(lines[max(0, call.lineno - 2):call.end_lineno])
            if "#" not in near:
                out.append(f"{where}: device='cpu' without a comment saying why")

    def visit(node: ast.AST, constructing: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = constructing
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = (child.name == "__init__" and isinstance(node, ast.ClassDef)
                         and node.name in modules)
            if isinstance(child, ast.Call) and not constructing:
                device = next((k.value for k in child.keywords if k.arg == "device"), None)
                if _is_factory(child):
                    check(child, device, f"torch.{child.func.attr}")
                elif _is_derived(child) and device is not None:
                    check(child, device, child.func.attr)
            visit(child, inner)

    visit(tree, False)
    return out


def test_every_tensor_factory_names_its_device():
    sources = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "megamoe")):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                sources[os.path.relpath(path, ROOT)] = open(path, encoding="utf-8").read()
    trees = {path: ast.parse(s) for path, s in sources.items()}
    modules = module_classes(list(trees.values()))
    assert {"GPTModel", "RMSNorm", "ProjectionRMSNorm", "MoELayer"} <= modules
    found = [v for path, s in sources.items()
             for v in violations(s, path, modules, trees[path])]
    assert found == []


def test_the_lint_sees_what_it_must():
    src = ("import torch\n"
           "from torch import nn\n"
           "class M(nn.Module):\n"
           "    def __init__(self):\n"
           "        self.w = torch.zeros(3)\n"  # module construction: allowed
           "    def f(self, x):\n"
           "        a = torch.zeros(3)\n"  # no device
           "        b = torch.arange(3, device=x.device)\n"
           "        c = torch.tensor([1], device='cpu')\n"  # cpu without a comment
           "        # host metadata\n"
           "        d = torch.tensor([1], device='cpu')\n"
           "        return torch.Generator()\n"  # no device
           "class Sub(M):\n"
           "    def __init__(self):\n"
           "        self.v = torch.ones(2)\n"  # a module through its base: allowed
           "class Check:\n"
           "    def __init__(self, x):\n"
           "        self.bad = torch.zeros((), dtype=torch.bool)\n"  # run time: no device
           "        self.n = x.new_zeros(3)\n"  # the source's device: fine
           "        self.m = x.new_zeros(3, device='cpu')\n"  # cpu without a comment
           "        self.k = torch.zeros_like(x, device='cpu')\n")  # cpu without a comment
    got = violations(src, "m.py")
    assert [v.split()[0] for v in got] == ["m.py:7", "m.py:9", "m.py:12", "m.py:18",
                                           "m.py:20", "m.py:21"], got


def test_library_entry_points_take_the_mesh_device():
    """Entry points that make the tensors of their own collectives take the device (the
    mesh's) with no default: a CPU default hands NCCL host tensors."""
    import inspect

    from megamoe.moe.cost_model import CollectiveCosts
    from megamoe.parallelize import enable_adaptive_parallelism

    for fn in (CollectiveCosts.measure, enable_adaptive_parallelism):
        assert inspect.signature(fn).parameters["device"].default is inspect.Parameter.empty
