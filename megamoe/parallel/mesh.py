"""Process groups. Owns torch.distributed initialisation and every group the code uses.

Layers never look groups up globally: whoever needs one is handed it from this object.
Today the mesh is pure data parallel (TP = PP = CP = EP = 1, enforced by the argument
rules); tensor, pipeline and expert groups are added here as those features land.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class Mesh:
    rank: int
    world_size: int
    dp_group: Optional[dist.ProcessGroup]  # None when world_size == 1
    backend: Optional[str]

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def is_logging_rank(self) -> bool:
        """The last rank logs, as in Megatron (it holds the loss under pipelining)."""
        return self.rank == self.world_size - 1

    def barrier(self) -> None:
        if self.dp_group is not None:
            dist.barrier(group=self.dp_group)


def init_mesh(backend: Optional[str] = None, timeout_minutes: float = 10.0) -> Mesh:
    """Initialise torch.distributed from torchrun's environment (no-op for one process).

    The timeout applies to every collective, so a hung one ends with an error instead of
    blocking forever.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 and not dist.is_initialized():
        return Mesh(rank=0, world_size=1, dp_group=None, backend=None)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return Mesh(rank=dist.get_rank(), world_size=dist.get_world_size(),
                dp_group=dist.group.WORLD, backend=backend)


def destroy_mesh(mesh: Mesh) -> None:
    if mesh.dp_group is not None and dist.is_initialized():
        dist.destroy_process_group()
