"""Device lint: every tensor the code makes lives on a known device.

On a GPU, a tensor factory without `device=` makes a CPU tensor; fed to a NCCL collective
or mixed with the model's tensors it fails (or, worse, silently copies). gloo accepts CPU
tensors, so no CPU test would notice. The rule, checked on every module of megamoe/:
each call of a torch tensor factory (and of torch.Generator) outside module construction
(`__init__` of a class: parameters and buffers follow the device the model is built on,
meta included) passes `device=`; `device="cpu"` is allowed only for host metadata that
never meets a device tensor or a collective, with a comment on the same or the line before
saying so.
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


def _is_cpu(value: ast.AST) -> bool:
    text = ast.unparse(value)
    return text in ("'cpu'", '"cpu"', "torch.device('cpu')", 'torch.device("cpu")')


def violations(source: str, path: str) -> list[str]:
    tree = ast.parse(source)
    lines = source.splitlines()
    out = []

    def visit(node: ast.AST, constructing: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = constructing
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name == "__init__" and isinstance(node, ast.ClassDef)
            if isinstance(child, ast.Call) and _is_factory(child) and not constructing:
                device = next((k.value for k in child.keywords if k.arg == "device"), None)
                where = f"{path}:{child.lineno} torch.{child.func.attr}"
                if device is None:
                    out.append(f"{where}: no device=")
                elif _is_cpu(device):
                    near = " ".join(lines[max(0, child.lineno - 2):child.end_lineno])
                    if "#" not in near:
                        out.append(f"{where}: device='cpu' without a comment saying why")
            visit(child, inner)

    visit(tree, False)
    return out


def test_every_tensor_factory_names_its_device():
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "megamoe")):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                found += violations(open(path, encoding="utf-8").read(),
                                    os.path.relpath(path, ROOT))
    assert found == []


def test_the_lint_sees_what_it_must():
    src = ("import torch\n"
           "class M:\n"
           "    def __init__(self):\n"
           "        self.w = torch.zeros(3)\n"  # construction: allowed
           "    def f(self, x):\n"
           "        a = torch.zeros(3)\n"  # no device
           "        b = torch.arange(3, device=x.device)\n"
           "        c = torch.tensor([1], device='cpu')\n"  # cpu without a comment
           "        # host metadata\n"
           "        d = torch.tensor([1], device='cpu')\n"
           "        return torch.Generator()\n")  # no device
    got = violations(src, "m.py")
    assert [v.split()[0] for v in got] == ["m.py:6", "m.py:8", "m.py:11"], got
