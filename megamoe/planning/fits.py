"""Refuse a training run that cannot fit, before anything is allocated.

An absurd size (`--micro-batch-size 1e20`, `--seq-length 1e11`, `--train-iters 1e18`)
otherwise fails late and badly: an allocation that swaps the host to a standstill, a
kernel OOM kill, or an index build that grows until the machine dies. The memory model
the planner and `--dry-run` use (dry_run.per_rank_memory) prices one rank of the launch's
own layout from shapes alone, so a training run checks it first: above the memory the rank
has by more than the model's stated error it refuses with one line; within the error it
warns and goes on (the estimate may be high). `--dry-run` never refuses: it is how a user
sizes a layout for a machine they are not on.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from megamoe.config import RunConfig
from megamoe.config.fields import ConfigError
from megamoe.planning.dry_run import per_rank_memory

# The memory model's stated error: activations within 25% of measured bytes
# (activations.py); weights, gradients and optimizer states are counted exactly.
MARGIN = 0.25
# Bytes of host index per training sample: Megatron's shuffle index (int64) and sample
# index ([doc, offset] int32 pairs) as the data builder keeps them.
INDEX_BYTES_PER_SAMPLE = 16


class DoesNotFit(ConfigError):
    """The run's shapes need more memory than this machine has; names the flags."""


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rank_memory(device: Optional[torch.device] = None) -> tuple[int, str]:
    """(bytes, what) of the memory one rank trains in: its GPU's, else the host's."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    return host_memory_bytes(), "the host's memory"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_fits(run: RunConfig, warn: Callable[[str], None] = print,
               memory: Optional[tuple[int, str]] = None,
               host_bytes: Optional[int] = None) -> None:
    """Raise DoesNotFit when one rank's estimate exceeds its memory by more than MARGIN,
    or the data indices the run asks for exceed the host's; warn when within MARGIN."""
    have, what = memory if memory is not None else rank_memory()
    need = per_rank_memory(run)[0]["total"]
    flags = ("--micro-batch-size, --seq-length, the model's sizes or the parallel layout "
             "(see pretrain_gpt.py --dry-run and tools/plan_parallel.py)")
    if need > have * (1 + MARGIN):
        raise DoesNotFit(f"one rank needs about {_gib(need)} but {what} is {_gib(have)}: "
                         f"reduce {flags}")
    if need > have:
        warn(f"warning: one rank needs about {_gib(need)}, {what} is {_gib(have)} (within "
             f"the memory model's {MARGIN:.0%} error): it may run out of memory")
    samples = run.train.train_iters * run.train.global_batch_size
    host = host_bytes if host_bytes is not None else host_memory_bytes()
    if samples * INDEX_BYTES_PER_SAMPLE > host:
        raise DoesNotFit(f"--train-iters/--train-samples ask for {samples:,} samples, whose "
                         f"data indices alone need {_gib(samples * INDEX_BYTES_PER_SAMPLE)}"
                         f" of the host's {_gib(host)}")
