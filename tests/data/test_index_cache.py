"""build_once: one process builds an index, the others wait for it, bounded by a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from megamoe.data import index_cache
from megamoe.data.errors import DataError
from megamoe.data.index_cache import build_once


def _writer(paths, calls, delay=0.0):
    def build():
        calls.append(threading.get_ident())
        time.sleep(delay)
        for p in paths:
            with open(p, "w") as f:
                f.write("x")
    return build


def test_one_builds_the_others_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(index_cache, "POLL_S", 0.01)
    paths = [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]
    calls, results = [], []
    threads = [threading.Thread(target=lambda: results.append(
        build_once(paths, _writer(paths, calls, 0.3), "idx", timeout_s=30)))
        for _ in range(4)]
    threads[0].start()
    while not calls:  # the first holds the lock and builds; the others arrive meanwhile
        time.sleep(0.01)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    # a waiter sees the files appear ("waited") or, if it polls after the lock is gone,
    # takes the lock and finds them ("cached"): either way the build ran once
    # (in the order the threads finished: a waiter can see the files before the builder
    # has returned)
    first, *others = sorted(results)
    assert len(calls) == 1 and first == "built"
    assert set(others) <= {"waited", "cached"} and "waited" in results
    assert build_once(paths, _writer(paths, calls), "idx") == "cached" and len(calls) == 1
    assert not os.path.exists(paths[0] + ".lock")


def test_waiter_times_out_naming_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(index_cache, "POLL_S", 0.01)
    paths = [str(tmp_path / "a.npy")]
    with open(paths[0] + ".lock", "w") as f:
        f.write("otherhost 123\n")
    with pytest.raises(DataError, match=r"a\.npy\.lock: waited 0 s for otherhost 123"):
        build_once(paths, _writer(paths, []), "idx", timeout_s=0.05)


def test_lock_of_a_dead_local_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    paths = [str(tmp_path / "a.npy")]
    with open(paths[0] + ".lock", "w") as f:
        f.write(f"{socket.gethostname()} {dead}\n")
    calls = []
    assert build_once(paths, _writer(paths, calls), "idx", timeout_s=5) == "built"
    assert len(calls) == 1


def test_failed_build_releases_the_lock(tmp_path):
    paths = [str(tmp_path / "a.npy")]

    def boom():
        raise RuntimeError("disk on fire")
    with pytest.raises(RuntimeError):
        build_once(paths, boom, "idx")
    assert not os.path.exists(paths[0] + ".lock")
