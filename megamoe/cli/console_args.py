"""The operator's console flags (megamoe extensions; training/console.py, cli/
resolved_config.py and planning/dry_run.py do the work): how many first iterations get a
line before --log-interval, and the dry run's machine-readable output."""

from __future__ import annotations

import argparse

from megamoe.cli.rules import ArgumentError

# How many of the first iterations are logged on their own (Megatron-LM: none, the first
# line comes at --log-interval; 0 restores that).
DEFAULT_FIRST_ITERATIONS = 3


def add_console_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("console (megamoe extensions)")
    g.add_argument("--log-first-iterations", type=int, default=DEFAULT_FIRST_ITERATIONS,
                   metavar="N",
                   help="log the first N steps of the run (a resumed one too) each on its "
                        "own line, without waiting for --log-interval (0: Megatron-LM's "
                        "console, first line at --log-interval)")
    g.add_argument("--json", action="store_true",
                   help="with --dry-run: print the report as one JSON line instead of the "
                        "table")


def check_console_args(args: argparse.Namespace) -> None:
    """--json belongs to --dry-run (a flag that changes nothing is an error)."""
    if args.json and not args.dry_run:
        raise ArgumentError("--json needs --dry-run (it selects the dry run's output)")
