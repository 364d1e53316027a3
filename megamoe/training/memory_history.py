"""--record-memory-history and --memory-snapshot-path (Megatron-LM's): the CUDA caching
allocator records every allocation and free with its Python stack from before the model is
built, and each profiled rank (--profile-ranks; none given: all) dumps a snapshot to
`<path stem>_<rank><ext>` on the first iteration and every --log-interval, and to
`<path stem>_oom_rank_<rank><ext>` when it runs out of memory, as Megatron's
start_memory_history_recording and training_log do. Open the pickles in
https://pytorch.org/memory_viz.

It is a CUDA allocator feature: on any other device the run stops before training with
one line (a launch script is still checked anywhere by --dry-run, which never gets here).
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

from megamoe.config import LoggingConfig
from megamoe.config.fields import ConfigError

MAX_ENTRIES = 100_000  # alloc/free events kept (Megatron's trace_alloc_max_entries)


def _memory():
    """torch.cuda.memory (a seam: the tests record the calls on a CPU machine)."""
    return torch.cuda.memory


def _attach_oom_observer(observer: Callable[..., None]) -> None:
    torch._C._cuda_attach_out_of_memory_observer(observer)


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _profiled(config: LoggingConfig, rank: int) -> bool:
    ranks = config.profile_ranks
    return config.record_memory_history and (not ranks or rank in ranks)


def snapshot_path(config: LoggingConfig, rank: int, oom: bool = False) -> str:
    base, ext = os.path.splitext(config.memory_snapshot_path)
    return f"{base}_oom_rank_{rank}{ext}" if oom else f"{base}_{rank}{ext}"


def start_memory_history(config: LoggingConfig, rank: int, device: torch.device,
                         log: Callable[[str], None]) -> None:
    """Before the model is built: start recording on a profiled rank (a ConfigError off
    CUDA), with a snapshot dumped on an out-of-memory error."""
    if not config.record_memory_history:
        return
    if not _is_cuda(device):
        raise ConfigError(f"--record-memory-history records the CUDA caching allocator; "
                          f"this run is on {device.type} (--dry-run checks a GPU script "
                          "anywhere)")
    if not _profiled(config, rank):
        return
    _memory()._record_memory_history(True, trace_alloc_max_entries=MAX_ENTRIES,
                                     trace_alloc_record_context=True)

    def on_oom(device_index: int, alloc: int, device_alloc: int, device_free: int) -> None:
        path = snapshot_path(config, rank, oom=True)
        _memory()._dump_snapshot(path)
        sys.stderr.write(f"[OOM] rank {rank} saved memory snapshot to {path}\n")

    _attach_oom_observer(on_oom)
    log(f"> memory history recording enabled (rank {rank}); snapshots will be written to "
        f"'{config.memory_snapshot_path}'")


def dump_memory_snapshot(config: LoggingConfig, rank: int, iteration: int,
                         first: bool) -> None:
    """On the first iteration of the run and every --log-interval: this rank's snapshot
    (overwritten each time: the latest history, as Megatron's)."""
    if _profiled(config, rank) and (first or iteration % config.log_interval == 0):
        _memory()._dump_snapshot(snapshot_path(config, rank))
