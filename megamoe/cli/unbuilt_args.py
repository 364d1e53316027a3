"""Every Megatron-LM flag megamoe does not build yet, parsed with Megatron's own argparse
shape (config/megatron_unbuilt.txt, generated from Megatron's parser) and refused in one
line: "not supported yet: --flag" (exit 2), where argparse alone would say "unrecognized
arguments" or, worse, read the flag's values as other arguments.

A flag counts as given when its parsed value differs from Megatron's default, as for the
hand-listed flags of config/unsupported.py: a script that spells out a default asks for
nothing megamoe lacks. A flag Megatron converts with its own function or whose default is
an enum ("other", "<other>") is refused whenever it appears. The deprecated flags
Megatron's validate_args itself rejects get Megatron's message instead.

Each flag parses into its own private attribute (UNBUILT_DEST + the flag), never Megatron's
dest: Megatron gives several flags one dest (--X / --no-X), and a dest megamoe reads must
not be overwritten by a refused spelling. The attributes are removed once checked, so the
rest of megamoe never sees them.
"""

from __future__ import annotations

import argparse

from megamoe.config import ConfigError
from megamoe.config.megatron_unbuilt import UNBUILT

UNBUILT_DEST = "megatron_unbuilt:"
OTHER = "<other>"
# Deprecated flags Megatron-LM rejects in validate_args (megatron/training/arguments.py at
# d98e8a64), with its message.
MEGATRON_REJECTS = {
    "--batch-size": "--batch-size argument is no longer valid, use --micro-batch-size instead",
    "--warmup": "--warmup argument is no longer valid, use --lr-warmup-fraction instead",
    "--model-parallel-size": "--model-parallel-size is no longer valid, use "
                             "--tensor-model-parallel-size instead",
    "--checkpoint-activations": "--checkpoint-activations is no longer valid, use "
                                "--recompute-activations, or, for more control, "
                                "--recompute-granularity and --recompute-method.",
}
_ACTIONS: list[argparse.Action] | None = None
TYPES = {"int": int, "float": float, "str": str, "other": str, None: None}


def built_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The long flags megamoe's parser reads itself (not parsed only to be refused here)."""
    return {s for a in parser._actions for s in a.option_strings
            if s.startswith("--") and not a.dest.startswith(UNBUILT_DEST)}


def _unbuilt_actions() -> list[argparse.Action]:
    """The table's actions, made once per process: argparse's add_argument for ~600 flags
    costs ~10 ms, paid by every parser built otherwise. An action holds only its own
    settings, so one object serves every parser."""
    global _ACTIONS
    if _ACTIONS is None:
        g = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        for flag, kind, nargs, typ, choices, _default, _dest in UNBUILT:
            common = dict(dest=UNBUILT_DEST + flag, default=argparse.SUPPRESS,
                          help=argparse.SUPPRESS)
            if kind == "store":
                g.add_argument(flag, nargs=nargs, type=TYPES[typ], choices=choices, **common)
            else:  # store_true / store_false: Megatron's value when given
                g.add_argument(flag, action="store_const", const=kind == "store_true", **common)
        _ACTIONS = list(g._actions)
    return _ACTIONS


def add_unbuilt_args(parser: argparse.ArgumentParser) -> None:
    """Parse each table flag with Megatron's shape. Called after every built flag: a flag
    megamoe has since built (its line not yet deleted) keeps megamoe's meaning."""
    built = built_flags(parser)
    g = parser.add_argument_group(
        "Megatron-LM flags not supported yet",
        f"{len(UNBUILT)} more flags of Megatron-LM's parser are recognised and refused with "
        "'not supported yet: --flag' (docs/megatron-compatibility.md)")
    for action in _unbuilt_actions():
        if action.option_strings[0] not in built:
            g._add_action(action)


def refused_flags(args: argparse.Namespace) -> list[str]:
    """Every unbuilt flag `args` gives a value other than Megatron's default (table order)."""
    out = []
    for flag, _kind, _nargs, typ, _choices, default, _dest in UNBUILT:
        key = UNBUILT_DEST + flag
        if key in vars(args) and (typ == "other" or default == OTHER
                                  or vars(args)[key] != default):
            out.append(flag)
    return out


def check_unbuilt(args: argparse.Namespace) -> None:
    """Refuse the first unbuilt flag given (ConfigError: one line, exit 2), then drop the
    private attributes, so nothing after the command line sees them."""
    given = refused_flags(args)
    for flag, *_ in UNBUILT:
        vars(args).pop(UNBUILT_DEST + flag, None)
    if given:
        raise ConfigError(MEGATRON_REJECTS.get(given[0], f"not supported yet: {given[0]}"))
