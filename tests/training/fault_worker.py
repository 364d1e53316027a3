"""pretrain_gpt.py with one deliberate fault on one rank (test helper, not a product hook).

    MEGAMOE_FAULT=<kind>:<rank>:<iteration>:<seconds> python tests/training/fault_worker.py FLAGS

kinds:
  stall_step   sleep before training step <iteration> (a rank stuck outside any collective)
  extra_allreduce  an all-reduce on the world group before step <iteration> that the other
               ranks never join (mismatched participants)
  stall_mesh   sleep before creating the mesh's process groups (stuck group creation)
  stall_init   sleep before initialising torch.distributed at all
  die_step     exit at once (os._exit(9), as if killed) before step <iteration>
  kill_step    SIGKILL itself before step <iteration> of this process (a resumed process
               counts from its first step, so a restarted rank does not die again)
  late_clock   this rank's run started <seconds> earlier (--exit-duration-in-mins differs)
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megamoe.cli import main as cli_main  # noqa: E402
from megamoe.parallel import mesh as mesh_module  # noqa: E402
from megamoe.training import loop, pretrain  # noqa: E402


def _install(kind: str, rank: int, iteration: int, seconds: float) -> None:
    me = int(os.environ.get("RANK", "0"))
    if me != rank:
        return
    if kind in ("stall_step", "extra_allreduce", "die_step", "kill_step"):
        original = loop.train_step
        calls = {"n": 0}

        def train_step(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == iteration:
                if kind == "stall_step":
                    time.sleep(seconds)
                elif kind == "die_step":
                    os._exit(9)
                elif kind == "kill_step":
                    os.kill(os.getpid(), signal.SIGKILL)
                else:
                    dist.all_reduce(torch.ones(3))
            return original(*args, **kwargs)

        loop.train_step = train_step
    elif kind == "stall_mesh":
        build = mesh_module.build_mesh

        def build_mesh(*args, **kwargs):
            time.sleep(seconds)
            return build(*args, **kwargs)

        mesh_module.build_mesh = build_mesh
    elif kind == "late_clock":
        real = time.time
        pretrain.time = type("Clock", (), {"time": staticmethod(lambda: real() - seconds)})
    elif kind == "stall_init":
        init = pretrain.init_mesh

        def init_mesh(*args, **kwargs):
            time.sleep(seconds)
            return init(*args, **kwargs)

        pretrain.init_mesh = init_mesh
    else:
        raise SystemExit(f"unknown fault {kind!r}")


if __name__ == "__main__":
    fault = os.environ.get("MEGAMOE_FAULT")
    if fault:
        k, r, i, s = fault.split(":")
        _install(k, int(r), int(i), float(s))
    sys.exit(cli_main.main(sys.argv[1:]))
