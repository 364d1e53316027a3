"""Print the option strings of Megatron-LM's pretrain_gpt.py parser, one a line.

tests/fixtures/megatron_flags.txt is this output for the Megatron-LM commit it names: it
decides which megamoe flags are megamoe extensions (tests/test_extension_flags.py).
Refresh it against a newer checkout:

    git -C Megatron-LM archive HEAD megatron | tar -x -C /tmp/mlm
    cd /tmp/mlm && python /path/to/megamoe/tools/dump_megatron_flags.py > flags.txt

Megatron's parser imports megatron.core, which imports triton (absent on a CPU machine)
and needs Python 3.12's typing.override; both are stubbed here: building the parser never
runs a kernel.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
import typing


class _Meta(type):
    """Any attribute of a stubbed triton object is another stub class."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (), {"__init__": lambda self, *a, **k: None,
                                "__call__": lambda self, *a, **k: self})


class _Module(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        stub = _Meta(name, (), {"__init__": lambda self, *a, **k: None,
                                "__call__": lambda self, *a, **k: self})
        setattr(self, name, stub)
        return stub


class _TritonFinder:
    """Resolves `triton` and its submodules to stubs (decorators return the function)."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Module(spec.name)
        m.__path__, m.__version__ = [], "3.7.1"
        m.jit = lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f)
        m.autotune = m.heuristics = lambda *a, **k: (lambda f: f)
        return m

    def exec_module(self, module) -> None:
        pass


def main() -> None:
    import argparse

    import torch._dynamo  # noqa: F401  (torch first: it must see no triton)

    sys.meta_path.insert(0, _TritonFinder())
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    sys.argv = ["pretrain_gpt.py"]
    sys.path.insert(0, os.getcwd())  # the Megatron-LM checkout
    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    print("\n".join(sorted(flags)))


if __name__ == "__main__":
    main()
