"""The Megatron-LM flags megamoe does not parse yet, with their argparse shape in Megatron's
parser: the generated table megatron_unbuilt.txt next to this file (one flag a line, a
Python literal; its header says what each field means; tools/dump_megatron_flags.py
--unbuilt writes it). Read once at import, every field checked (a malformed line names
the file and line), never evaluated as code (ast.literal_eval).
"""

from __future__ import annotations

import ast
import os

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_unbuilt.txt")
KINDS = ("store", "store_true", "store_false")
TYPES = ("int", "float", "str", "other")
PLAIN = (type(None), bool, int, float, str)


def _check(row: object) -> bool:
    """Whether `row` is (flag, action, nargs, type, choices, default, dest) of the table."""
    if not (isinstance(row, tuple) and len(row) == 7):
        return False
    flag, kind, nargs, typ, choices, default, dest = row
    on_off = kind in ("store_true", "store_false")
    return (isinstance(flag, str) and flag.startswith("--") and " " not in flag
            and kind in KINDS
            and (nargs == 0 if on_off else (nargs in (None, "+", "*", "?")
                                            or (type(nargs) is int and 0 < nargs < 64)))
            and (typ is None if on_off else typ in TYPES)
            and (choices is None or (isinstance(choices, list) and len(choices) > 0
                                     and all(type(c) in PLAIN for c in choices)))
            and (type(default) in PLAIN or (isinstance(default, list)
                                            and all(type(v) in PLAIN for v in default)))
            and isinstance(dest, str) and dest.isidentifier())


def read_table(path: str = TABLE) -> tuple[tuple, ...]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip() or line.startswith("#"):
                continue
            try:
                row = ast.literal_eval(line.strip())
            except (ValueError, SyntaxError):
                row = None
            if not _check(row):
                raise ValueError(f"{path}:{number}: not a (flag, action, nargs, type, "
                                 f"choices, default, dest) line: {line.strip()[:80]}")
            rows.append(row)
    return tuple(rows)


UNBUILT = read_table()
