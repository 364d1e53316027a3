"""Process groups. Owns torch.distributed initialisation and every group the code uses.

Rank layout (Megatron-Core order, tensor-parallel fastest):

    dense (attention, dense MLP):  rank = tp + TP * (cp + CP * (dp + DP * pp))
    MoE (parallel folding):        rank = etp + ETP * (ep + EP * (edp + EDP * pp))

Both layouts cover the same ranks with the same pipeline groups, so a pipeline stage is the
contiguous block of world / PP ranks in either view; EDP = world / (ETP * EP * PP).
`rank_groups` computes every group's rank lists as a pure function (unit-tested without
processes); `build_mesh` creates them, every one with `new_group(timeout=...)` as Megatron
does: a group created without a timeout gets torch's default (30 minutes on gloo) instead of
--distributed-timeout-minutes, so a hang in it would outlive the flag. The single-dimension
groups also form two `torch.distributed.device_mesh.DeviceMesh`es over the same ranks (dense
pp x dp x cp x tp and expert pp x edp x ep x etp, for DTensor checkpoints). Layers never
look groups up globally: whoever needs a group is handed it from the `Mesh`, which can also
name any of its groups (`Mesh.describe`) for error messages.

The mesh also owns this rank's one device (`Mesh.device`: cuda:LOCAL_RANK on a GPU
machine, else the CPU): the model is materialised there, batches are moved there, and
every tensor the trainer makes is made there (or on the CPU on purpose, as host metadata).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megamoe.config import ParallelConfig

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
# The groups of one dimension each: tp, cp, dp, pp, ep, etp, edp.
SINGLE_DIMS = tuple(name for name, (_, inside) in GROUP_DIMS.items() if len(inside) == 1)


def _grid(sizes: dict[str, int], dims: tuple[str, ...]) -> torch.Tensor:
    world = 1
    for d in dims:
        world *= sizes[d]
    return torch.arange(world, device="cpu").reshape([sizes[d] for d in dims])  # rank ids


def rank_groups(parallel: ParallelConfig) -> dict[str, list[list[int]]]:
    """{group name: list of rank lists} for every group in GROUP_DIMS of the (validated)
    layout over its world size (pure function)."""
    s = parallel.sizes()
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
    backend: Optional[str]
    sizes: dict[str, int]  # every dimension: tp, cp, pp, ep, etp, dp, edp
    ranks: dict[str, int]  # this rank's index in each dimension's group
    groups: dict[str, Optional[dist.ProcessGroup]]  # every group of GROUP_DIMS and embd
    group_ranks: dict[str, list[int]]  # members of this rank's groups
    device: torch.device = torch.device("cpu")  # this rank's one device (default_device)
    device_mesh: Optional[DeviceMesh] = None  # dense pp x dp x cp x tp
    expert_device_mesh: Optional[DeviceMesh] = None  # pp x edp x ep x etp
    # init_mesh created the default process group (else the caller had: it keeps it).
    owns_world: bool = False

    def size(self, name: str) -> int:
        return self.sizes[name]

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        return self.groups[name]

    def local_rank_in(self, name: str) -> int:
        return self.ranks[name]

    # Megatron-style accessors.
    dp_group = property(lambda self: self.group("dp"))
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

    def describe(self, group: Optional[dist.ProcessGroup]) -> str:
        """A group's name and members for messages ("dp group (ranks [0, 1])"); None is the
        world group."""
        if group is None or group is dist.group.WORLD:
            return f"world group ({self.world_size} ranks)"
        for name, g in self.groups.items():
            if g is group:
                return f"{name} group (ranks {self.group_ranks[name]})"
        try:
            return f"group of ranks {dist.get_process_group_ranks(group)}"
        except (RuntimeError, ValueError):
            return "a group this rank is not a member of"


def default_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK when CUDA is available (torchrun starts one
    process per GPU), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def single_process_mesh(device: Optional[torch.device] = None) -> Mesh:
    """The mesh of one process: every size 1, no group; `device` default_device()."""
    groups = (*GROUP_DIMS, "embd")
    return Mesh(rank=0, world_size=1, backend=None, sizes={n: 1 for n in SINGLE_DIMS},
                ranks={n: 0 for n in SINGLE_DIMS}, groups={n: None for n in groups},
                group_ranks={n: [0] for n in groups}, device=device or default_device())


def build_mesh(parallel: ParallelConfig, backend: str,
               device: Optional[torch.device] = None) -> Mesh:
    """Create every group of the layout on an initialised default process group; the
    mesh's device is `device` (default_device()).

    All ranks create all groups in the same order (torch.distributed requires it), each
    with --distributed-timeout-minutes and its name as group_desc (NCCL's watchdog names
    it when a collective times out). In `Mesh.groups`, groups of size 1 are None so
    single-rank dimensions cost no collectives; the DeviceMeshes hold every dimension.
    """
    device = device or default_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    if parallel.world_size != world:
        raise ValueError(f"the layout is for {parallel.world_size} ranks, the process group "
                         f"has {world}")
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    resolved = parallel.sizes()
    lists = rank_groups(parallel)
    # A middle pipeline stage belongs to no embedding group: None, no members.
    groups: dict[str, Optional[dist.ProcessGroup]] = {name: None for name in lists}
    mine: dict[str, list[int]] = {name: [] for name in lists}
    dims_pg: dict[str, dist.ProcessGroup] = {}  # every dimension, size 1 included
    for name, rank_lists in lists.items():
        single = name in SINGLE_DIMS
        for members in rank_lists:
            if len(members) == 1 and not single:
                pg = None
            else:
                pg = dist.new_group(members, timeout=timeout, group_desc=name)
            if rank in members:
                groups[name] = pg if len(members) > 1 else None
                mine[name] = members
                if single:
                    dims_pg[name] = pg
    meshes = {layout: DeviceMesh.from_group([dims_pg[d] for d in dims], device.type,
                                            mesh=_grid(resolved, dims), mesh_dim_names=dims)
              for layout, dims in (("dense", DENSE_DIMS), ("expert", EXPERT_DIMS))}
    ranks = {d: mine[d].index(rank) for d in SINGLE_DIMS}
    return Mesh(rank=rank, world_size=world, backend=backend, sizes=resolved, ranks=ranks,
                groups=groups, group_ranks=mine, device=device,
                device_mesh=meshes["dense"], expert_device_mesh=meshes["expert"])


def init_mesh(parallel: ParallelConfig) -> Mesh:
    """Initialise torch.distributed from torchrun's environment and build the mesh of the
    (validated) layout.

    The device is chosen (and made current) before the process group exists, and handed
    to NCCL as its device_id, so every rank binds its own GPU from the start. One process
    with all sizes 1 needs no process group (on a GPU it still runs there). The timeout
    (--distributed-timeout-minutes) applies to the rendezvous, every group's creation and
    every collective, so a hung one ends with an error instead of blocking forever.
    """
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if parallel.world_size == 1 and not dist.is_initialized():
        return single_process_mesh(device)
    backend = parallel.distributed_backend
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    owns_world = not dist.is_initialized()
    if owns_world:
        timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
        store, rank, world = _restart_store(timeout)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                                timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    mesh = build_mesh(parallel, backend, device)
    mesh.owns_world = owns_world
    return mesh


def _restart_store(timeout: datetime.timedelta) -> tuple[dist.Store, int, int]:
    """torchrun's env:// store, seen through a prefix named after this restart round.

    When torchrun (--max-restarts) restarts the workers after one died, they reconnect to
    the agent's store, which still holds the keys the failed round wrote (each group's
    addresses, barrier counters). A new round reading them waits for peers that are dead:
    on torch 2.13 the restarted workers hung in process-group creation. Keys under
    "megamoe/restart<TORCHELASTIC_RESTART_COUNT>/" are fresh in every round.
    """
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megamoe/restart{restart}/", store), rank, world


def destroy_mesh(mesh: Mesh) -> None:
    """Tear down what init_mesh made: every process group when it created the default one;
    when the caller had initialised torch.distributed (a library user, a test harness
    running several trainings in one process), only the mesh's own groups: the caller's
    group lives on (destroying it, then rendezvousing again on the same port, raced)."""
    if mesh.world_size == 1 or not dist.is_initialized():
        return
    if mesh.owns_world:
        dist.destroy_process_group()
        return
    world = dist.group.WORLD
    for group in {id(g): g for g in mesh.groups.values() if g is not None}.values():
        if group is not world:
            dist.destroy_process_group(group)
