"""Flag fuzzing: every flag of pretrain_gpt.py with hostile values, through the argument
rules and `--dry-run`, must end in success or one line and a non-zero exit, never a
traceback. Shared by the default suite's seeded sample and the slow set's full sweep."""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import shlex
import traceback
from typing import Iterator

from megamoe.cli.arguments import build_parser
from megamoe.cli.main import main
from megamoe.cli.unbuilt_args import UNBUILT_DEST

HUGE_INT = str(10**30)
INTS = ["-1", "0", "1", "3", "7", str(2**31), str(2**63), HUGE_INT, "1e3", "nan", "", "x"]
FLOATS = ["nan", "inf", "-inf", "1e400", "-1e400", "-1", "0", "1e-320", "1e30", "0.5", "",
          "x", "1,2"]
STRINGS = ["", "\udcff\udcfe", "../../etc/passwd", "/dev/null", "/", "x" * 5000, "a b",
           "[1]*100000000000", "-1", "nan", "None"]
SKIP = {"--help", "--config"}  # argparse's help exits 0; --config is fuzzed as a file path


def _values(action: argparse.Action) -> list[str]:
    if action.choices:
        return [*map(str, action.choices), "not-a-choice", ""]
    kind = getattr(action.type, "__name__", "") if action.type else ""
    if action.type is int or "int" in kind:
        return INTS
    if action.type is float or "float" in kind:
        return FLOATS
    return STRINGS


def cases(base: str) -> Iterator[list[str]]:
    """Every (flag, value) case: base flags plus one fuzzed flag (value cases, or the bare
    flag for switches), each also with two values where the flag takes several."""
    for action in build_parser("pretrain_gpt.py")._actions:
        if (not action.option_strings or action.option_strings[0] in SKIP
                or action.dest.startswith(UNBUILT_DEST)):  # refused (test_megatron_unbuilt)
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            yield [*shlex.split(base), flag]
            continue
        for v in _values(action):
            yield [*shlex.split(base), flag, v]
            if action.nargs in ("+", "*") or isinstance(action.nargs, int) and action.nargs > 1:
                yield [*shlex.split(base), flag, v, v]


def run_case(argv: list[str]) -> str | None:
    """None when the case ends well (exit 0, or 1/2 with exactly one stderr line naming
    the program), else what went wrong."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main([*argv, "--dry-run"])
    except SystemExit as e:
        code = e.code
    except BaseException:  # a traceback: the failure this fuzz exists to find
        return traceback.format_exc(limit=-3)
    lines = err.getvalue().strip().splitlines()
    if code == 0:
        return None
    if code in (1, 2) and len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: "):
        return None
    return f"exit {code}, stderr: {lines[-5:]}"


def fuzz(base: str, sample: int | None = None, seed: int = 0) -> list[str]:
    """Failures as 'argv -> what', for all cases or a seeded sample of them."""
    all_cases = list(cases(base))
    if sample is not None and sample < len(all_cases):
        all_cases = random.Random(seed).sample(all_cases, sample)
    failures = []
    for argv in all_cases:
        problem = run_case(argv)
        if problem is not None:
            failures.append(f"{shlex.join(argv[-3:])} -> {problem}")
    return failures
