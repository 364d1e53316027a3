"""setup.py's extras: the `gpu` extra installs only packages megamoe imports, the `hf`
extra holds what tools/checkpoint/convert.py imports from Hugging Face, the `data` extra
nltk for tools/preprocess_data.py --split-sentences."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extras() -> dict[str, list[str]]:
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "setup")
    kw = next(k.value for k in call.keywords if k.arg == "extras_require")
    return ast.literal_eval(kw)


def imported_modules(*dirs: str) -> set[str]:
    """Top-level names of every module imported anywhere under `dirs`."""
    names = set()
    for d in dirs:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                if f.endswith(".py"):
                    tree = ast.parse(open(os.path.join(base, f), encoding="utf-8").read())
                    for n in ast.walk(tree):
                        if isinstance(n, ast.Import):
                            names |= {a.name.split(".")[0] for a in n.names}
                        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                            names.add(n.module.split(".")[0])
    return names


def module_name(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0].replace("-", "_").lower()


def test_gpu_extra_installs_only_what_megamoe_imports():
    used = imported_modules("megamoe", "tools")
    unused = [r for r in extras()["gpu"] if module_name(r) not in used]
    assert not unused, f"the gpu extra installs {unused}, which nothing imports"


def test_hf_extra_covers_the_converters_imports():
    hf = {module_name(r) for r in extras()["hf"]}
    assert {"transformers", "safetensors"} <= hf
    assert "transformers" in imported_modules("tools/checkpoint")


def test_data_extra_holds_nltk_for_split_sentences():
    """--split-sentences imports nltk (megamoe/data/sentence_split.py), an optional
    dependency that only the `data` extra installs."""
    assert "nltk" in {module_name(r) for r in extras()["data"]}
    assert "nltk" in imported_modules("megamoe/data")
