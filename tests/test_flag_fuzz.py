"""Hostile flag values end in one line, never a traceback (issue 26): a seeded sample in
the default suite, every flag x value in the slow set (tests/flag_fuzz.py).

The cases run in a child process whose address space is capped (RLIMIT_AS), so a value
that would allocate without bound fails as a MemoryError traceback (reported) instead of
taking the machine down."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.flag_fuzz import run_case
from tests.training.test_pretrain import ROOT, TINY_MOE

BASE = f"{TINY_MOE} --train-iters 2"
ADDRESS_SPACE = 6 * 2**30  # torch's own mappings take ~3 GB of address space

CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from tests.flag_fuzz import fuzz
print(json.dumps(fuzz({base!r}, sample={sample!r}, seed={seed})))
"""


def _fuzz_in_child(sample: int | None, seed: int = 1, timeout: float = 600) -> list[str]:
    code = CHILD.format(limit=ADDRESS_SPACE, base=BASE, sample=sample, seed=seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=timeout)
    assert out.returncode == 0, f"fuzz child died ({out.returncode}): {out.stderr[-2000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_harness_reports_a_traceback(monkeypatch):
    """The harness can fail: an exception escaping main is a failure, with its trace."""
    def boom(argv):
        raise KeyError("boom")
    monkeypatch.setattr("tests.flag_fuzz.main", boom)
    assert "KeyError: 'boom'" in run_case(["--num-layers", "2"])


def test_seeded_flag_sample_is_one_line_each():
    failures = _fuzz_in_child(sample=300)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.slow
def test_every_flag_and_value_is_one_line_each():
    failures = _fuzz_in_child(sample=None, timeout=1800)
    assert not failures, f"{len(failures)} cases:\n" + "\n".join(failures[:60])
