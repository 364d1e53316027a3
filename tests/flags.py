"""Shared check for flag errors: exit code 2, exactly one line, no traceback."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.arguments import parse_args


def parse_error(capsys, flags: str, world_size: int) -> str:
    """Parse `flags` expecting a rule to reject them; returns the one-line message."""
    with pytest.raises(SystemExit) as exc:
        parse_args(shlex.split(flags), world_size=world_size)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err
