"""The megatron-core peer's Python: a venv of its own (megatron-core 0.19.2 on the CPU torch,
REFERENCE.md's recipe), built once and cached under ~/.cache/megamoe/mcore-venv/<versions>.

megamoe never imports megatron-core; tests run `peer.py` with this venv's Python as a
subprocess. The build holds a file lock, so concurrent tests (or pytest-xdist workers)
build it once; it is made in a temporary folder and renamed into place only after
`import megatron.core` works, so a half-built venv is never used.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Optional

from tests.cached_venv import cached_python

PYTHON = "3.11"
# transformers/tokenizers: Megatron-LM's tools/preprocess_data.py with a HuggingFace
# tokenizer (tests/data/test_preprocess_vs_megatron.py), the same versions as megamoe's venv.
PINS = ["torch==2.13.0", "numpy", "packaging", "psutil", "triton==3.7.1",
        "transformers==5.24.0", "tokenizers==0.23.3"]
MCORE = "megatron-core==0.19.2"
KEY = f"py{PYTHON}-torch2.13.0-triton3.7.1-mcore0.19.2-transformers5.24.0"
ROOT = os.path.join(os.path.expanduser(os.environ.get("MEGAMOE_CACHE", "~/.cache/megamoe")),
                    "mcore-venv")
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py")
PEER_LEGACY = os.path.join(os.path.dirname(PEER), "peer_legacy.py")
# the peer-only Transformer Engine stand-in (te_peer_stand_in/README.md)
TE_STAND_IN = os.path.join(os.path.dirname(PEER), "te_peer_stand_in")


class PeerUnavailable(RuntimeError):
    """The peer venv cannot be built here; the message says why."""


def _python() -> str:
    found = shutil.which(f"python{PYTHON}")
    if found is None:
        raise PeerUnavailable(f"python{PYTHON} is not on PATH (the megatron-core peer needs "
                              "it: megatron-core 0.19 imports on 3.11 with triton)")
    return found


def _run(cmd: list[str], log: str) -> None:
    with open(log, "a") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0:
        tail = open(log).read().strip().splitlines()[-1:] or ["?"]
        raise PeerUnavailable(f"`{' '.join(cmd[2:5])} ...` failed ({tail[0][:200]}); see {log}")


def _build(final: str) -> None:
    tmp = f"{final}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log = f"{final}.log"
    subprocess.run([_python(), "-m", "venv", tmp], check=True)
    py = os.path.join(tmp, "bin", "python")
    _run([py, "-m", "pip", "install", "-q", *PINS], log)
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--ignore-requires-python", MCORE],
         log)
    _run([py, "-c", "import megatron.core.dist_checkpointing"], log)
    os.replace(tmp, final)


def peer_python() -> str:
    """The cached venv's python, building it first if needed; PeerUnavailable if not."""
    return cached_python(ROOT, KEY, _build, PeerUnavailable)


def run_peer(args: list[str], timeout: float = 600, python: Optional[str] = None,
             script: str = PEER, te_stand_in: bool = False) -> None:
    """`peer.py ARGS` (or another `script` beside it) in the peer venv; AssertionError
    with its output's tail if it fails. te_stand_in: the peer's Transformer Engine
    stand-in importable as `transformer_engine` (its PYTHONPATH only)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    if te_stand_in:
        env["PYTHONPATH"] = TE_STAND_IN
    env.setdefault("OMP_NUM_THREADS", "1")
    # its own process group: on a timeout the ranks it forked end with it (a bare
    # subprocess.run kills only the launcher and leaves the ranks holding the cores)
    proc = subprocess.Popen([python or peer_python(), script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{os.path.basename(script)} {' '.join(args)} did not finish "
                             f"in {timeout:.0f} s (its process group was killed)") from None
    if proc.returncode != 0:
        raise AssertionError(f"{os.path.basename(script)} {' '.join(args)} failed:\n"
                             f"{stderr[-3000:]}")


if __name__ == "__main__":  # python -m tests.tools.megatron_peer.mcore_venv: build or find it
    print(peer_python())
    sys.exit(0)
