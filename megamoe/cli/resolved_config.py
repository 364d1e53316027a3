"""The run's resolved configuration: printed once (rank 0) in Megatron-LM's "arguments"
block, and saved as `resolved_config.yaml` in --save so that `--config` reruns it.

A preset plus command-line overrides plus Megatron's derived defaults (ffn = 4 x hidden,
query groups, ...) is hard to reconstruct from a launch script weeks later. The YAML holds
every flag whose parsed value differs from the parser's default, spelled as the flag
(`num-layers: 4`, `swiglu: true`), after the rules derived what they derive: loading it
with `--config` parses to the same configuration (tests/training/test_console.py checks
the round trip for every flag the flag audit samples). Flags that only steer this
invocation (--config, --dry-run, --json, --use-checkpoint-args, whose values are already
resolved into the others) are left out.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

import yaml

from megamoe.cli.extensions import NegationAction

NOT_SAVED = ("--config", "--dry-run", "--json", "--use-checkpoint-args", "--help")
# Values the rules derive from another flag that the parser refuses next to it: written
# only when that flag is not (derived dest -> the flag's dest).
DERIVED_FROM = {"global_batch_size": "step_batch_size_schedule"}
HEADER = ("# The resolved configuration of a megamoe run (flags that differ from the\n"
          "# defaults, after the rules derived theirs). Rerun it with\n"
          "#   python pretrain_gpt.py --config THIS_FILE [flags to override]\n")


def resolved_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """{flag name without "--": value} of every flag whose parsed value is not its default;
    on/off flags as true (given), a store_false flag (--no-X) as true when it is off."""
    out: dict = {}
    seen: set[str] = set()
    for action in parser._actions:
        flags = [s for s in action.option_strings if s.startswith("--")]
        if (not flags or isinstance(action, NegationAction) or action.dest in seen
                or flags[0] in NOT_SAVED or not hasattr(args, action.dest)):
            continue
        seen.add(action.dest)
        value = getattr(args, action.dest)
        source = DERIVED_FROM.get(action.dest)
        if value == action.default or (source and getattr(args, source, None) is not None):
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out[flags[0][2:]] = value == action.const  # default differs: the flag is given
        elif isinstance(value, (int, float, str, list)):
            out[flags[0][2:]] = value
    return out


def resolved_yaml(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    return HEADER + yaml.safe_dump(resolved_flags(args, parser), sort_keys=False)


def format_arguments(args: argparse.Namespace) -> list[str]:
    """Megatron-LM's startup block: every argument, sorted, dotted to its value."""
    width = 48
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(vars(args)):
        lines.append(f"  {name} {'.' * max(1, width - len(name))} {getattr(args, name)}")
    lines.append("-------------------- end of arguments ---------------------")
    return lines


def report_resolved_config(args: argparse.Namespace, parser: argparse.ArgumentParser,
                           print_fn: Callable[[str], None]) -> str:
    """Rank 0 prints the arguments block; every rank returns the YAML, which the run
    writes into --save once its setup has succeeded (training/run_record.py)."""
    if int(os.environ.get("RANK", "0")) == 0:
        for line in format_arguments(args):
            print_fn(line)
    return resolved_yaml(args, parser)
