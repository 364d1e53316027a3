"""Process groups. Owns torch.distributed initialisation and every group the code uses.

Rank layout (Megatron-Core order, tensor-parallel fastest):

    dense (attention, dense MLP):  rank = tp + TP * (cp + CP * (dp + DP * pp))
    MoE (parallel folding):        rank = etp + ETP * (ep + EP * (edp + EDP * pp))

Both layouts cover the same ranks with the same pipeline groups, so a pipeline stage is the
contiguous block of world / PP ranks in either view; EDP = world / (ETP * EP * PP).
`rank_groups` computes every group's rank lists as a pure function (unit-tested without
processes); `init_mesh` creates them. The single-dimension groups come from two
`torch.distributed.device_mesh.DeviceMesh`es over the same ranks (dense pp x dp x cp x tp
and expert pp x edp x ep x etp, exposed for DTensor/FSDP users); the combined groups
(tp-cp, dp-cp, tp-dp-cp, tp-ep, model parallel, embedding) are created from the pure rank
lists. Layers never look groups up globally: whoever needs a group is handed it from the
`Mesh`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DENSE_DIMS = ("pp", "dp", "cp", "tp")  # slowest -> fastest
EXPERT_DIMS = ("pp", "edp", "ep", "etp")
# Group name -> (layout, dims varying inside one group).
GROUP_DIMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("dense", ("tp",)),
    "cp": ("dense", ("cp",)),
    "dp": ("dense", ("dp",)),
    "pp": ("dense", ("pp",)),
    "dp_cp": ("dense", ("dp", "cp")),
    "tp_cp": ("dense", ("cp", "tp")),
    "tp_dp_cp": ("dense", ("dp", "cp", "tp")),
    "mp": ("dense", ("pp", "cp", "tp")),  # model parallel: everything but dp
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("etp",)),
    "edp": ("expert", ("edp",)),
    "tp_ep": ("expert", ("ep", "etp")),
}


class MeshError(ValueError):
    """A parallel layout that does not factor the world size; the message names sizes."""


@dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # None = tp

    def resolved(self, world_size: int) -> dict[str, int]:
        """All sizes including dp and edp; raises MeshError when they do not factor."""
        etp = self.tp if self.etp is None else self.etp
        sizes = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "ep": self.ep, "etp": etp}
        for name, v in sizes.items():
            if v < 1:
                raise MeshError(f"{name} size must be >= 1, got {v}")
        dense = self.tp * self.cp * self.pp
        if world_size % dense:
            raise MeshError(f"world size {world_size} is not divisible by tensor ({self.tp}) x "
                            f"context ({self.cp}) x pipeline ({self.pp}) parallel sizes")
        expert = etp * self.ep * self.pp
        if world_size % expert:
            raise MeshError(f"world size {world_size} is not divisible by expert tensor ({etp})"
                            f" x expert ({self.ep}) x pipeline ({self.pp}) parallel sizes")
        sizes["dp"] = world_size // dense
        sizes["edp"] = world_size // expert
        return sizes


def _grid(sizes: dict[str, int], dims: tuple[str, ...]) -> torch.Tensor:
    world = 1
    for d in dims:
        world *= sizes[d]
    return torch.arange(world).reshape([sizes[d] for d in dims])


def rank_groups(world_size: int, sizes: ParallelSizes) -> dict[str, list[list[int]]]:
    """{group name: list of rank lists} for every group in GROUP_DIMS (pure function)."""
    s = sizes.resolved(world_size)
    grids = {"dense": (_grid(s, DENSE_DIMS), DENSE_DIMS),
             "expert": (_grid(s, EXPERT_DIMS), EXPERT_DIMS)}
    out: dict[str, list[list[int]]] = {}
    for name, (layout, inside) in GROUP_DIMS.items():
        grid, dims = grids[layout]
        outside = [i for i, d in enumerate(dims) if d not in inside]
        within = [i for i, d in enumerate(dims) if d in inside]
        g = grid.permute(*outside, *within).reshape(-1, _numel(s, inside))
        out[name] = [sorted(row.tolist()) for row in g]
    # First and last pipeline stage of each pipeline group: tied embeddings are reduced here.
    out["embd"] = [sorted({row[0], row[-1]}) for row in out["pp"]]
    return out


def _numel(sizes: dict[str, int], dims: tuple[str, ...]) -> int:
    n = 1
    for d in dims:
        n *= sizes[d]
    return n


@dataclass
class Mesh:
    """This rank's view of the layout: sizes, ranks and groups (None when size 1)."""

    rank: int
    world_size: int
    dp_group: Optional[dist.ProcessGroup]  # None when the dp size is 1
    backend: Optional[str]
    sizes: dict[str, int] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)  # this rank's index in each group
    groups: dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)  # members of my groups
    device_mesh: Optional[DeviceMesh] = None  # dense pp x dp x cp x tp
    expert_device_mesh: Optional[DeviceMesh] = None  # pp x edp x ep x etp

    def size(self, name: str) -> int:
        if name in self.sizes:
            return self.sizes[name]
        return self.world_size if name == "dp" and not self.sizes else 1

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        if name == "dp" and not self.groups:
            return self.dp_group
        return self.groups.get(name)

    def local_rank_in(self, name: str) -> int:
        if name == "dp" and not self.ranks:
            return self.rank
        return self.ranks.get(name, 0)

    # Megatron-style accessors.
    dp_size = property(lambda self: self.size("dp"))
    dp_rank = property(lambda self: self.local_rank_in("dp"))
    tp_size = property(lambda self: self.size("tp"))
    tp_rank = property(lambda self: self.local_rank_in("tp"))
    tp_group = property(lambda self: self.group("tp"))
    cp_size = property(lambda self: self.size("cp"))
    pp_size = property(lambda self: self.size("pp"))
    pp_rank = property(lambda self: self.local_rank_in("pp"))
    pp_group = property(lambda self: self.group("pp"))
    ep_size = property(lambda self: self.size("ep"))
    etp_size = property(lambda self: self.size("etp"))
    edp_size = property(lambda self: self.size("edp"))

    @property
    def is_logging_rank(self) -> bool:
        """The last rank logs, as in Megatron (it holds the loss under pipelining)."""
        return self.rank == self.world_size - 1

    def barrier(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()


def _single_process_mesh() -> Mesh:
    names = ("tp", "cp", "dp", "pp", "ep", "etp", "edp")
    return Mesh(rank=0, world_size=1, dp_group=None, backend=None,
                sizes={n: 1 for n in names}, ranks={n: 0 for n in names},
                groups={n: None for n in GROUP_DIMS}, group_ranks={n: [0] for n in GROUP_DIMS})


def build_mesh(sizes: ParallelSizes, backend: str) -> Mesh:
    """Create every group of the layout on an initialised default process group.

    All ranks create all groups in the same order (torch.distributed requires it); groups
    of size 1 are None so single-rank dimensions cost no collectives.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    resolved = sizes.resolved(world)
    lists = rank_groups(world, sizes)
    device = "cuda" if backend == "nccl" else "cpu"
    meshes = {layout: DeviceMesh(device, _grid(resolved, dims), mesh_dim_names=dims)
              for layout, dims in (("dense", DENSE_DIMS), ("expert", EXPERT_DIMS))}
    groups: dict[str, Optional[dist.ProcessGroup]] = {}
    mine: dict[str, list[int]] = {}
    for name, rank_lists in lists.items():
        layout, inside = GROUP_DIMS.get(name, (None, ()))
        if len(inside) == 1:  # one mesh dimension: the DeviceMesh already made it
            pg = meshes[layout].get_group(inside[0])
            members = next(m for m in rank_lists if rank in m)
            groups[name] = pg if len(members) > 1 else None
            mine[name] = members
            continue
        for members in rank_lists:
            pg = dist.new_group(members) if len(members) > 1 else None
            if rank in members:
                groups[name] = pg
                mine[name] = members
    ranks = {d: mine[d].index(rank) for d in ("tp", "cp", "dp", "pp", "ep", "etp", "edp")}
    return Mesh(rank=rank, world_size=world, dp_group=groups["dp"], backend=backend,
                sizes=resolved, ranks=ranks, groups=groups, group_ranks=mine,
                device_mesh=meshes["dense"], expert_device_mesh=meshes["expert"])


def init_mesh(backend: Optional[str] = None, timeout_minutes: float = 10.0, *,
              tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
              etp: Optional[int] = None) -> Mesh:
    """Initialise torch.distributed from torchrun's environment and build the mesh.

    One process with all sizes 1 needs no process group. The timeout applies to every
    collective, so a hung one ends with an error instead of blocking forever.
    """
    sizes = ParallelSizes(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 and not dist.is_initialized():
        sizes.resolved(1)  # a layout needing more ranks fails with a clear message
        return _single_process_mesh()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return build_mesh(sizes, backend)


def destroy_mesh(mesh: Mesh) -> None:
    if mesh.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
