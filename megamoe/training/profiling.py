"""Megatron's --profile: a profiling range over iterations (--profile-step-start,
--profile-step-end] on the ranks of --profile-ranks (all ranks when empty).

Two back-ends, as Megatron's train():
- nsys (default): cudaProfilerStart() before the step after --profile-step-start
  iterations and cudaProfilerStop() after iteration --profile-step-end, for
  `nsys profile --capture-range=cudaProfilerApi`. CUDA only (cli/rules.py refuses it for a
  CPU run; --dry-run accepts it);
- --use-pytorch-profiler: torch.profiler with Megatron's schedule (wait start-1, warmup 1,
  active end-start, once), stepped at the top of every iteration; the trace goes to
  {--tensorboard-dir}/../torch_profile/rank-{rank}.json.gz.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megamoe.config import LoggingConfig


class Profiler:
    """The profiling range of one training run on this rank (nothing without --profile)."""

    def __init__(self, config: LoggingConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        ranks = config.profile_ranks
        self.on = config.profile and (not ranks or rank in ranks)
        self.torch_profiler: Optional[torch.profiler.profile] = None
        self.running = False

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        out = os.path.join(os.path.dirname(os.path.abspath(self.config.tensorboard_dir)),
                           "torch_profile")
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"rank-{self.rank}.json.gz"))

    def __enter__(self) -> Profiler:
        c = self.config
        if self.on and c.use_pytorch_profiler:
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(c.profile_step_start - 1, 0),
                    warmup=1 if c.profile_step_start > 0 else 0,
                    active=c.profile_step_end - c.profile_step_start, repeat=1),
                on_trace_ready=self._trace_ready)
            self.torch_profiler.start()
            self.running = True
        return self

    def before_step(self, iterations_done: int) -> None:
        if not self.on:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif iterations_done == self.config.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self.running = True

    def after_step(self, iterations_done: int) -> None:
        if self.on and self.running and iterations_done == self.config.profile_step_end:
            self._stop()

    def _stop(self) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
        else:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
        self.running = False

    def __exit__(self, *exc) -> None:
        if self.running:  # (a run that ended inside the range)
            self._stop()
