"""--check-weight-hash-across-dp-replicas-interval N (Megatron-LM's): at the start of
training and after every N-th iteration, every rank hashes each of its parameters and the
hashes are compared over the data-parallel replicas (routed-expert parameters over the
expert-data-parallel group, as Megatron's check_param_hashes_across_dp_replicas). Replicas
that drifted apart (a silent data corruption, a missed reduction) stop the run on every
rank with one line naming the iteration, the first differing parameter and the rank.

Megatron hashes with SHA-1 on the host (every parameter copied to the CPU). Here each
parameter's bytes are hashed on its device: a position-mixed 32-bit word hash summed to one
int64 (any change of a single bit changes it; a collision needs a crafted change). The
hashes of all parameters form one small tensor per rank, gathered once per group; the
verdict is read in one host sync per check, never per parameter.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megamoe.model.fp8.params import value
from megamoe.parallel.mesh import Mesh

FLAG = "--check-weight-hash-across-dp-replicas-interval"
_CHUNK = 1 << 22  # words hashed per pass: bounds the int32 temporaries (16 MiB each)
_GOLDEN = -1640531527  # 0x9E3779B9 as int32: spreads word positions
_MIX = 0x045D9F3B  # a 32-bit integer-hash multiplier (odd: a bijection mod 2**32)


class WeightHashMismatch(RuntimeError):
    """The data-parallel replicas' parameters differ; raised on every rank."""


def _words(p: torch.Tensor) -> torch.Tensor:
    """The parameter's bytes as int32 words (bytes widened when they are not a multiple
    of 4), on its device."""
    raw = p.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 4:
        return raw.to(torch.int32)
    if raw.storage_offset() % 4:  # a view into a flat buffer at an unaligned byte
        raw = raw.clone()
    return raw.view(torch.int32)


@torch.no_grad()
def param_hash(p: torch.Tensor) -> torch.Tensor:
    """One int64 (0-dim, on p's device) that changes with any bit of p: each word mixed
    with its position (murmur-style finaliser, wrapping int32 arithmetic), summed."""
    words = _words(p)
    total = torch.zeros((), dtype=torch.int64, device=p.device)
    for start in range(0, words.numel(), _CHUNK):
        x = words[start:start + _CHUNK]
        pos = torch.arange(start, start + x.numel(), dtype=torch.int64, device=p.device)
        x = x ^ (pos.to(torch.int32) * _GOLDEN)
        for shift in (16, 13):
            x = (x ^ (x >> shift)) * _MIX
        total += (x ^ (x >> 16)).sum(dtype=torch.int64)
    return total


def _first_mismatch(hashes_P: torch.Tensor, group: Optional[dist.ProcessGroup],
                    size: int) -> torch.Tensor:
    """[first differing parameter, first rank of `group` whose hash of it differs from
    rank 0's] (the parameter count / group size where all agree), on the device."""
    n = hashes_P.numel()
    gathered = [torch.empty_like(hashes_P) for _ in range(size)]
    dist.all_gather(gathered, hashes_P, group=group)
    diff_GP = torch.stack(gathered) != gathered[0]
    idx_P = torch.arange(n, device=hashes_P.device)
    first = torch.where(diff_GP.any(0), idx_P, n).min()
    ranks_G = torch.arange(size, device=hashes_P.device)
    column_G = diff_GP[:, first.clamp(max=n - 1)]
    rank = torch.where(column_G, ranks_G, size).min()
    return torch.stack([first, rank])


def check_weight_hashes(model: torch.nn.Module, mesh: Mesh, iteration: int) -> bool:
    """Compare this rank's parameters with its replicas'; returns whether a comparison ran
    (False: no replica to compare with). Raises WeightHashMismatch on every rank when any
    group's replicas differ. Every rank must call it (collectives)."""
    kinds = (("dp", "data-parallel", False), ("edp", "expert-data-parallel", True))
    if mesh.world_size == 1 or not dist.is_initialized() or \
            not any(mesh.size(g) > 1 for g, _, _ in kinds):
        return False
    checks = [(g, label, [(n, p) for n, p in model.named_parameters()
                          if getattr(p, "expert_parallel", False) == expert])
              for g, label, expert in kinds if mesh.size(g) > 1]
    checks = [c for c in checks if c[2]]
    found = [_first_mismatch(torch.stack([param_hash(value(p)) for _, p in params]),
                             mesh.group(g), mesh.size(g)) for g, _, params in checks]
    # every rank stops, also those whose own groups agree: the first global rank that saw
    # a difference, agreed over the world (its only host read)
    bad = torch.full((1,), mesh.world_size, dtype=torch.int64, device=mesh.device)
    for (_, _, params), f in zip(checks, found):
        bad = torch.minimum(bad, torch.where(f[0] < len(params), mesh.rank, mesh.world_size))
    dist.all_reduce(bad, op=dist.ReduceOp.MIN)
    values = torch.cat([bad, *found]).tolist()
    if values[0] == mesh.world_size:
        return True
    head = f"iteration {iteration}: parameter hashes not matching across DP replicas ({FLAG})"
    for i, (g, label, params) in enumerate(checks):
        param, rank = values[1 + 2 * i], values[2 + 2 * i]
        if param < len(params):
            raise WeightHashMismatch(
                f"{head}: {params[param][0]} differs on {label} rank {rank} (global rank "
                f"{mesh.group_ranks[g][rank]}) from {label} rank 0 (global rank "
                f"{mesh.group_ranks[g][0]})")
    raise WeightHashMismatch(f"{head}: found by global rank {values[0]} (its message names "
                             "the parameter)")
