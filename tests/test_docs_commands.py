"""Slow set: the documentation's commands work when pasted. Every ```bash block tagged
`<!-- run -->` in README.md and docs/*.md runs in bash on the CPU, page by page (README,
getting-started, then the others by name), in a copy of the repository; the no-run
blocks are counted and reported. `mkdocs build --strict` builds the site (API reference
included) with MkDocs from a cached venv of the `docs` extra's packages (tests/docs_venv.py).

Shortening: TRAIN_ITERS=4 for every block (scripts/pretrain_tiny_cpu.sh and the
quickstart read it; the pages' own pretrain_gpt.py commands say
`--train-iters ${TRAIN_ITERS:-N}`). The copy gets a throwaway `.venv` that sees this
interpreter's packages and carries the set-up scripts' install stamps, so
scripts/env.sh installs nothing and no environment outside the copy is touched."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig

import pytest

from tests import docs_venv
from tests.docs_markdown import ROOT, markdown_files, shell_blocks

pytestmark = pytest.mark.slow

SHORTENING = {"TRAIN_ITERS": "4"}
IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info", "site",
                                "wandb", "checkpoints", ".pytest_cache", ".ruff_cache")


def _throwaway_venv(repo: str) -> dict[str, str]:
    """`repo/.venv` over this interpreter's packages, stamped as installed; the env to run
    the blocks in."""
    venv = os.path.join(repo, ".venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    purelib = sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv})
    with open(os.path.join(purelib, "_megamoe_docs_test.pth"), "w") as f:
        f.write("\n".join([repo, *site.getsitepackages()]) + "\n")
    for extras in ("base", "logging", "test,logging"):  # what scripts/env.sh checks
        open(os.path.join(venv, f".megamoe-installed-{extras}"), "w").close()
    path = [os.path.join(venv, "bin"), os.path.dirname(sys.executable),
            os.environ.get("PATH", "")]
    return {**os.environ, **SHORTENING, "PATH": os.pathsep.join(path), "VIRTUAL_ENV": venv,
            "PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


def _run(code: str, repo: str, env: dict[str, str], where: str) -> None:
    p = subprocess.run(["bash", "-e", "-c", code], cwd=repo, env=env, text=True,
                       capture_output=True, timeout=1800)
    assert p.returncode == 0, (f"{where} exited {p.returncode}\n{code}\n"
                               f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory):
    """A copy of the repository after the quickstart, which several pages start from."""
    repo = str(tmp_path_factory.mktemp("docs") / "megamoe")
    shutil.copytree(ROOT, repo, ignore=IGNORE)  # copy2: mtimes kept, setup.py not "newer"
    env = _throwaway_venv(repo)
    _run("bash scripts/quickstart.sh", repo, env, "the quickstart")
    return repo, env


PAGES = markdown_files()


def test_no_run_blocks_are_counted(capsys):
    blocks = [b for f in PAGES for b in shell_blocks(f)]
    skipped = [b for b in blocks if b.tag == "no-run"]
    with capsys.disabled():
        print(f"\n{len(skipped)} of {len(blocks)} documented bash blocks are no-run:")
        for b in skipped:
            print(f"  {b.path}:{b.line}: {b.reason}")
    assert len(skipped) < len(blocks)


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("page", PAGES)
def test_runnable_blocks_work_when_pasted(repo_copy, page):
    repo, env = repo_copy
    for b in shell_blocks(page):
        if b.tag == "run":
            _run(b.code, repo, env, f"{b.path}:{b.line}")


@pytest.mark.timeout(600)
def test_mkdocs_builds_strict(tmp_path):
    # MKDOCS=/path/mkdocs picks one; else the cached venv (tests/docs_venv.py), skipped only
    # where no package index can be reached to build it.
    mkdocs = [os.environ["MKDOCS"]] if os.environ.get("MKDOCS") else None
    if not mkdocs:
        try:
            mkdocs = docs_venv.mkdocs()
        except docs_venv.DocsVenvUnavailable as e:
            pytest.skip(f"no mkdocs: {e}")
    p = subprocess.run([*mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "site" / "getting-started" / "index.html").is_file()
