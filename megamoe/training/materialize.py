"""Materialising a model built on the meta device: this rank's shards only, on its device.

Every logical tensor (named as in the single-process model, training/checkpoint/
sharded_state.py) draws its values vector by vector along one dimension that no layout
ever splits (its "vector axis"): vector i (flat index i over the other dimensions) is
normal(0, std) from a generator seeded by (--seed, the tensor's name, i). A shard is then
exactly the single-process values at its global position, whatever the layout, and a rank
draws exactly the vectors it holds: no rank ever holds or generates a full-size tensor,
and host memory stays near the rank's own weight bytes.

Which tensors draw what: a module lists its normal-initialised parameters and their std
in `init_stds` ({name: std}); norm weights are ones; everything else (biases, buffers,
counters) is zeros. Values are generated on the host (a CPU generator: the numbers do not
depend on the device) and copied to the device in chunks; with `on_host`
(--use-cpu-initialization, Megatron's meaning) the whole shard is built in host memory
first and copied once. Both give the same values.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
from torch import nn

from megamoe.model.norms import RMSNorm
from megamoe.parallel.mesh import Mesh
from megamoe.training.checkpoint.sharded_state import Entry, Part, model_entries

_CHUNK_BYTES = 1 << 24  # rows generated on the host per copy to the device
_MASK = (1 << 63) - 1


def row_seed(seed: int, key: str, row: int) -> int:
    """The generator seed of row `row` of logical tensor `key` (a 63-bit mix)."""
    x = (seed * 0x9E3779B97F4A7C15 + zlib.crc32(key.encode()) * 0xBF58476D1CE4E5B9
         + row * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _MASK
    return x ^ (x >> 29)


def _init_kind(module: nn.Module, name: str) -> tuple[str, float]:
    """("normal", std) | ("fill", value) for tensor `name` of `module`."""
    std = getattr(module, "init_stds", {}).get(name)
    if std is not None:
        return "normal", std
    if name == "weight" and isinstance(module, (nn.LayerNorm, RMSNorm)):
        return "fill", 1.0
    return "fill", 0.0


def _vector_axis(part: Part, ndim: int) -> int:
    """The dimension drawn as one vector: the last that no layout ever splits, so a rank
    draws only the vectors it holds (a row-parallel weight draws columns, an expert fc1
    draws along its hidden size). A part of a formerly whole tensor (`whole_key`: the
    shared experts) draws along the last dim, as that tensor did; a rank holding a slice
    of its vectors draws them whole and keeps the slice."""
    if part.whole_key is not None:
        return ndim - 1
    free = [d for d in range(ndim) if d not in part.shardable_dims]
    return free[-1] if free else ndim - 1


def _flat_indices(shape: tuple[int, ...], dims: list[int], offsets: list[int],
                  counts: tuple[int, ...]) -> list[int]:
    """Row-major flat indices over `dims` of the global `shape`, for the region starting
    at `offsets` with `counts` (plain integers: no tensor, so it runs under a fake mode)."""
    rows = [0]
    for d in dims:
        rows = [r * shape[d] + i for r in rows for i in range(offsets[d], offsets[d] + counts[d])]
    return rows


def _draw(seed: int, key: str, rows: list[int], length: int, std: float) -> torch.Tensor:
    host = torch.empty(len(rows), length, device="cpu")  # drawn on the host
    for j, row in enumerate(rows):
        g = torch.Generator(device="cpu").manual_seed(row_seed(seed, key, row))  # host RNG
        host[j].normal_(0.0, std, generator=g)
    return host


def _fill_normal(part: Part, local: torch.Tensor, std: float, seed: int) -> None:
    """`part`'s region of its logical tensor, drawn vector by vector along _vector_axis
    (vector i: flat index i over the other dims) and copied into `local` a chunk at a time
    along the first of the other dims."""
    shape, offsets = part.global_shape, part.global_offsets(tuple(local.shape))
    axis = _vector_axis(part, len(shape))
    key, first = (part.key, 0) if part.whole_key is None else (part.whole_key, part.whole_row)
    others = [d for d in range(len(shape)) if d != axis]
    if not others:  # 1-D: one vector
        local.copy_(_draw(seed, key, [0], shape[axis], std)[0].narrow(
            0, offsets[axis], local.shape[axis]))
        return
    c, rest = others[0], others[1:]
    inner = _flat_indices(shape, rest, offsets, tuple(local.shape))
    per = 1
    for d in rest:
        per *= shape[d]
    order = [c, *rest, axis]
    perm = [order.index(d) for d in range(len(shape))]
    k = max(1, _CHUNK_BYTES // (4 * shape[axis] * len(inner)))
    for i0 in range(0, local.shape[c], k):
        n = min(k, local.shape[c] - i0)
        rows = [(first + offsets[c] + i0 + i) * per + r for i in range(n) for r in inner]
        host = _draw(seed, key, rows, shape[axis], std)
        host = host.narrow(1, offsets[axis], local.shape[axis])  # a split axis: the slice
        host = host.reshape(n, *[local.shape[d] for d in rest], local.shape[axis])
        host = host.permute(perm)
        local.narrow(c, i0, n).copy_(host)


def _materialize_tensor(module: nn.Module, name: str, t: torch.Tensor,
                        entry: Optional[Entry], seed: int,
                        device: torch.device) -> torch.Tensor:
    kind, value = _init_kind(module, name)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    if kind == "fill":
        return out.fill_(value)
    if entry is None:
        raise ValueError(f"{type(module).__name__}.{name}: no single-process name to draw "
                         "its values from (custom modules cannot be built on the meta device)")
    for part in entry.parts:
        _fill_normal(part, part.local(out), value, seed)
    return out


@torch.no_grad()
def materialize(model: nn.Module, mesh: Mesh, seed: int, *, on_host: bool = False
                ) -> nn.Module:
    """Give every meta tensor of `model` (this rank's part, after parallelize) its values,
    on `mesh.device` (built on the CPU first with `on_host`). In place; returns `model`."""
    entries = {id(e.tensor): e for e in model_entries(model, mesh if mesh.world_size > 1
                                                      else None)}
    device = torch.device("cpu") if on_host else mesh.device
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    real = _materialize_tensor(module, name, t, entries.get(id(t)), seed,
                                               device)
                    if on_host:
                        real = real.to(mesh.device)
                    if isinstance(t, nn.Parameter):
                        real = nn.Parameter(real, requires_grad=t.requires_grad)
                        real.__dict__.update(t.__dict__)  # the parallel attributes
                    done[id(t)] = real
                store[name] = done[id(t)]
    return model
