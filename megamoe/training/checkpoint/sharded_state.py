"""Layout-free names for a (TP / PP / EP / ETP-sharded) model's tensors, for
torch.distributed.checkpoint (DCP).

Every tensor a rank holds is described as one or more `Part`s: a slice of the local tensor
that is one rank's contiguous shard of a *logical* tensor named as in the single-process
`GPTModel.state_dict()`:

- pipeline stages use global layer indices (`decoder.layers.{layer_index}`), the embedding,
  final norm and output layer keep their single-process names;
- fused tensors are split into their logical parts, so each part is a plain TP / ETP shard
  whatever the layout: `linear_qkv.weight.{q,k,v}`, `linear_fc1.weight.{gate,up}`
  (swiglu), routed experts `fc1_weight.{gate,up}` / `fc1_bias.{gate,up}`;
- routed experts are stacked by global expert id ([E, ...], sharded over ep on dim 0 and,
  with expert tensor parallelism, over etp on the feature dim); `SequentialExperts` modules
  are named `local_experts.{global id}`.

A part becomes a DTensor over this rank's tp (or ep x etp) DeviceMesh with `Shard`
placements; replicas (dp, edp, tp for replicated tensors) carry the same key and offsets and
DCP writes them once. Loading the same description under another layout makes DCP read the
slices this layout needs: that is the resharding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Shard

from megamoe.model.norms import ProjectionRMSNorm
from megamoe.model.pipeline_stage import GPTStage, PipelineModel
from megamoe.moe.experts import GroupedExperts, SequentialExperts
from megamoe.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from megamoe.parallel.mesh import Mesh

WORD_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Part:
    """`local.narrow(dim, start, length)` is this rank's shard of logical tensor `key`."""

    key: str
    global_shape: tuple[int, ...]
    dim: Optional[int] = None  # None: the whole local tensor
    start: int = 0
    length: int = 0
    device_mesh: Optional[DeviceMesh] = None  # None: not sharded (replicated or one rank)
    placements: tuple[Placement, ...] = ()
    shardable_dims: tuple[int, ...] = ()  # dims some layout splits (whatever this one does)
    # Set for the shared experts' TP-sharded tensors, which were one replicated tensor
    # before they were split over TP: this part is rows [whole_row, whole_row + rows) of
    # logical tensor `whole_key`. The materializer draws it as those rows (along the last
    # dim, as the whole tensor was drawn: seeds keep their values) and a checkpoint that
    # saved the whole tensor loads into it (dist.py).
    whole_key: Optional[str] = None
    whole_row: int = 0

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dim is None else t.narrow(self.dim, self.start, self.length)

    def global_offsets(self, local_shape: tuple[int, ...]) -> list[int]:
        """Where this rank's `local_shape` region of the part starts in the logical tensor
        (the Shard placements' coordinates x local sizes)."""
        offsets = [0] * len(local_shape)
        for i, placement in enumerate(self.placements):
            mesh = self.device_mesh
            coord = mesh.get_local_rank(i) if mesh.ndim > 1 else mesh.get_local_rank()
            offsets[placement.dim] += coord * local_shape[placement.dim]
        return offsets

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """The shard as DCP sees it: a DTensor placed in the logical tensor, or plain."""
        if self.device_mesh is None:
            return local
        return DTensor.from_local(local, self.device_mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.global_shape),
                                  stride=_contiguous_stride(self.global_shape))


@dataclass
class Entry:
    """One local parameter or persistent buffer and the logical parts it holds."""

    name: str  # this rank's state_dict name (for messages)
    tensor: torch.Tensor
    parts: list[Part]
    save: bool = True  # False for the last stage's copy of a tied embedding (saved once)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


class _Meshes:
    """Sub-DeviceMeshes of this rank's layout, built once per save / load."""

    def __init__(self, mesh: Optional[Mesh]) -> None:
        self.mesh = mesh
        self._cache: dict[tuple[str, ...], DeviceMesh] = {}

    def size(self, name: str) -> int:
        return 1 if self.mesh is None else self.mesh.size(name)

    def get(self, dims: tuple[str, ...]) -> Optional[DeviceMesh]:
        dims = tuple(d for d in dims if self.size(d) > 1)
        if not dims:
            return None
        if dims not in self._cache:
            root = self.mesh.expert_device_mesh if dims[0] in ("ep", "etp") else \
                self.mesh.device_mesh
            self._cache[dims] = root[dims if len(dims) > 1 else dims[0]]
        return self._cache[dims]


def _split(key: str, local_shape: tuple[int, ...], dim: int, names: list[Optional[str]],
           sharded: list[tuple[str, int]], meshes: _Meshes) -> list[Part]:
    """`local` is `len(names)` equal blocks along `dim`; each block is sharded over the
    mesh dims in `sharded` ((mesh dim, tensor dim) pairs, only those of size > 1 count)."""
    active = [(m, d) for m, d in sharded if meshes.size(m) > 1]
    device_mesh = meshes.get(tuple(m for m, _ in active))
    placements = tuple(Shard(d) for _, d in active)
    length = local_shape[dim] // len(names)
    parts = []
    for i, name in enumerate(names):
        shape = list(local_shape)
        shape[dim] = length
        for m, d in active:
            shape[d] *= meshes.size(m)
        parts.append(Part(key if name is None else f"{key}.{name}", tuple(shape),
                          dim if len(names) > 1 else None, i * length, length,
                          device_mesh, placements, tuple(sorted({d for _, d in sharded}))))
    return parts


def _column_names(module: ColumnParallelLinear, prefix: str) -> list[Optional[str]]:
    n = len(module.blocks)
    if n == 1:
        return [None]
    if n == 3 and prefix.endswith("linear_qkv."):
        return ["q", "k", "v"]
    if n == 2 and prefix.endswith("linear_fc1."):
        return ["gate", "up"]
    return [f"part{i}" for i in range(n)]


def _parts(module: nn.Module, pname: str, t: torch.Tensor, key: str,
           meshes: _Meshes) -> list[Part]:
    parts = _layout_parts(module, pname, t, key, meshes)
    if getattr(module, "was_replicated", False):  # a shared expert's linear (experts.py)
        rows = [p.global_shape[0] for p in parts]
        parts = [replace(p, whole_key=key, whole_row=sum(rows[:i]))
                 for i, p in enumerate(parts)]
    return parts


def _layout_parts(module: nn.Module, pname: str, t: torch.Tensor, key: str,
                  meshes: _Meshes) -> list[Part]:
    shape = tuple(t.shape)
    if isinstance(module, ColumnParallelLinear):  # rows = blocks, each split over tp
        parts, start = [], 0
        for name, block in zip(_column_names(module, key[: -len(pname)]), module.blocks):
            n = block // module.tp.size
            whole = _split(key if name is None else f"{key}.{name}", (n, *shape[1:]), 0,
                           [None], [("tp", 0)], meshes)[0]
            dim = None if len(module.blocks) == 1 else 0
            parts.append(Part(whole.key, whole.global_shape, dim, start, n,
                              whole.device_mesh, whole.placements, whole.shardable_dims))
            start += n
        return parts
    if isinstance(module, RowParallelLinear) and pname == "weight":
        return _split(key, shape, 1, [None], [("tp", 1)], meshes)
    if isinstance(module, (VocabParallelEmbedding, ProjectionRMSNorm)):
        return _split(key, shape, 0, [None], [("tp", 0)], meshes)
    if isinstance(module, GroupedExperts):
        def over(dim: int) -> list[tuple[str, int]]:  # etp counts only when it is > 1
            return [("ep", 0), ("etp", dim)]

        names = ["gate", "up"] if module.gated else [None]
        if pname == "fc1_weight":
            return _split(key, shape, 2, names, over(2), meshes)
        if pname == "fc1_bias":
            return _split(key, shape, 1, names, over(1), meshes)
        if pname == "fc2_weight":
            return _split(key, shape, 1, [None], over(1), meshes)
        return _split(key, shape, 0, [None], [("ep", 0)], meshes)  # fc2_bias
    return [Part(key, shape)]


def _expert_offset(experts: nn.Module, meshes: _Meshes) -> int:
    offset = getattr(experts, "expert_offset", None)
    if offset is not None:
        return int(offset)
    ep_rank = 0 if meshes.mesh is None else meshes.mesh.local_rank_in("ep")
    return ep_rank * experts.num_local_experts if meshes.size("ep") > 1 else 0


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = [(n, p) for n, p in module._parameters.items() if p is not None]
    out += [(n, b) for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set]
    return out


def _walk(module: nn.Module, local: str, key: str, meshes: _Meshes, out: list[Entry]) -> None:
    if isinstance(module, PipelineModel):
        for c, chunk in enumerate(module.chunks):
            _walk(chunk, f"{local}chunks.{c}.", key, meshes, out)
        return
    if isinstance(module, GPTStage):
        children = [("embedding", "embedding", module.embedding),
                    ("final_layernorm", "decoder.final_layernorm", module.final_layernorm),
                    ("output_layer", "output_layer", module.output_layer),
                    ("mtp", "mtp", module.mtp)]
        children += [(f"layers.{j}", f"decoder.layers.{layer.layer_index}", layer)
                     for j, layer in enumerate(module.layers)]
        for lname, kname, child in children:
            if child is not None:
                _walk(child, f"{local}{lname}.", f"{key}{kname}.", meshes, out)
        copy = module.shared_output_weight
        if copy is not None:  # the embedding's last-stage copy (tied / MTP): loads from it
            parts = _split(WORD_EMBEDDING, tuple(copy.shape), 0, [None], [("tp", 0)], meshes)
            out.append(Entry(f"{local}shared_output_weight", copy, parts, save=False))
        return
    for pname, t in _own_tensors(module):
        out.append(Entry(local + pname, t, _parts(module, pname, t, key + pname, meshes)))
    for cname, child in module.named_children():
        ckey = cname
        if isinstance(module, SequentialExperts) and cname == "local_experts":
            offset = _expert_offset(module, meshes)
            for j, expert in enumerate(child):
                _walk(expert, f"{local}local_experts.{j}.",
                      f"{key}local_experts.{offset + j}.", meshes, out)
            continue
        _walk(child, f"{local}{cname}.", f"{key}{ckey}.", meshes, out)


def model_entries(model: nn.Module, mesh: Optional[Mesh] = None) -> list[Entry]:
    """Every parameter and persistent buffer of this rank's `model` with its logical parts.
    `mesh` None: a single-process model (every part is the whole logical tensor)."""
    out: list[Entry] = []
    _walk(model, "", "", _Meshes(mesh), out)
    return out
