#!/usr/bin/env python
"""Stub each read flag and run its named test, which must then fail (the flag audit's
mutation run; tests/test_flag_audit.py holds the classification).

    python tools/audit_flags.py [--only=--flag-a,--flag-b] [--jobs 2]

For every flag in class (a) of the audit, one pytest process runs the flag's named test
with MEGAMOE_AUDIT_STUB=FLAG and tests/audit first on PYTHONPATH, whose sitecustomize makes
every parse forget that flag (its value goes back to the parser default) in that process
and in every process it starts. Prints one JSON object: per flag "caught" (the test failed)
or "NOT CAUGHT", and the totals. Exit status 1 when a flag was not caught or a named test
fails without the stub.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megamoe.cli.rules import NOT_SUPPORTED_YET  # noqa: E402
from tests.test_flag_audit import CLI_READ, REFUSED_VALUES, config_flags  # noqa: E402


def named_tests() -> dict[str, str]:
    """flag -> the pytest node that must fail when the flag is not read."""
    out = {f: f"tests/test_flag_audit.py::test_flag_reaches_its_config_field[{f}]"
           for f in config_flags() if f not in NOT_SUPPORTED_YET and f not in REFUSED_VALUES}
    out.update(CLI_READ)
    return dict(sorted(out.items()))


def _pytest(node: str, stub: str | None) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "audit"), ROOT]))
    if stub:
        env["MEGAMOE_AUDIT_STUB"] = stub
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-m", "slow or not slow", node], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    return p.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated flags (write --only=--flag,...)")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    tests = named_tests()
    if a.only:
        tests = {f: tests[f] for f in a.only.split(",")}
    start = time.time()
    with ThreadPoolExecutor(a.jobs) as pool:
        baseline = dict(zip(sorted(set(tests.values())),
                            pool.map(lambda n: _pytest(n, None), sorted(set(tests.values())))))
        stubbed = dict(zip(tests, pool.map(lambda f: _pytest(tests[f], f), tests)))
    result = {f: ("caught" if rc != 0 else "NOT CAUGHT") for f, rc in stubbed.items()}
    failing = [n for n, rc in baseline.items() if rc != 0]
    missed = [f for f, r in result.items() if r != "caught"]
    print(json.dumps({"flags": result, "named_tests_failing_without_stub": failing,
                      "caught": len(result) - len(missed), "not_caught": missed,
                      "wall_s": round(time.time() - start, 1)}, indent=1))
    return 1 if missed or failing else 0


if __name__ == "__main__":
    sys.exit(main())
