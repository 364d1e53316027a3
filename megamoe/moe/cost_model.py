"""Cost model for adaptive expert parallelism (adaptive.py): which of "ep", "dp", "tp" moves
the fewest seconds of data for one MoE layer's forward + backward.

Every mode does the same expert FLOPs, so they differ in what crosses the links (token rows
for "ep", expert weights for "dp", both halves for "tp") and in how many rows are shuffled
locally (permutation). Each collective costs latency + bytes x seconds-per-byte (the
alpha-beta model), fitted from two message sizes timed on the real ep group at start-up and
agreed on by all ranks (the slowest rank's numbers), so every rank picks the same mode.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megamoe.parallel.comm import (
    all_to_all_uneven,
    gather_from_sequence,
    reduce_scatter_to_sequence,
)


@dataclass(frozen=True)
class LinkCost:
    latency_s: float
    seconds_per_byte: float

    def __call__(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte


@dataclass(frozen=True)
class CollectiveCosts:
    """Bytes are each rank's input: the shard for all_gather, the send buffer for
    all_to_all, the full tensor for reduce_scatter; `copy` is a local row gather."""

    all_gather: LinkCost
    all_to_all: LinkCost
    reduce_scatter: LinkCost
    copy: LinkCost

    @classmethod
    def measure(cls, group, device: torch.device,
                sizes: tuple[int, int] = (1 << 14, 1 << 21), repeats: int = 5
                ) -> CollectiveCosts:
        """Time each collective at two sizes (bytes, fp32) on `group`, with tensors on
        `device`: the mesh's, and required (a CPU default would hand NCCL host tensors);
        the fit is all-reduced with MAX so that every rank holds identical numbers. On a
        GPU a collective returns before it runs: the device is synchronised before the
        clock is read."""
        world = dist.get_world_size(group)

        def reverse(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, torch.arange(x.shape[0] - 1, -1, -1, device=x.device))

        ops = {
            "all_gather": lambda x: gather_from_sequence(x, group),
            "all_to_all": lambda x: all_to_all_uneven(x, [x.shape[0] // world] * world,
                                                      [x.shape[0] // world] * world, group),
            "reduce_scatter": lambda x: reduce_scatter_to_sequence(x, group),
            "copy": reverse,
        }
        fitted = []
        with torch.no_grad():
            for op in ops.values():
                rows = [world * max(nbytes // (4 * 64 * world), 1) for nbytes in sizes]
                points = [_time_op(op, torch.zeros(n, 64, device=device), group, repeats)
                          for n in rows]
                (s1, t1), (s2, t2) = points
                per_byte = max((t2 - t1) / (s2 - s1), 1e-13)
                fitted += [max(t1 - s1 * per_byte, 0.0), per_byte]
        agreed = torch.tensor(fitted, dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        values = agreed.tolist()
        return cls(*(LinkCost(values[2 * i], values[2 * i + 1]) for i in range(len(ops))))

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_op(op, x: torch.Tensor, group, repeats: int) -> tuple[int, float]:
    """(bytes, median seconds) of `op(x)` after a warm-up, the device synchronised."""
    op(x)  # warm-up
    times = []
    for _ in range(repeats):
        _sync(x.device)
        dist.barrier(group=group)
        start = time.perf_counter()
        op(x)
        _sync(x.device)
        times.append(time.perf_counter() - start)
    return x.numel() * 4, statistics.median(times)


@dataclass(frozen=True)
class ModeCostInputs:
    tokens: int  # tokens per rank entering the layer's expert part
    hidden: int
    topk: int
    num_experts: int
    ep_size: int
    local_expert_numel: int  # parameters of this rank's experts
    bytes_per_element: int
    dispatcher: str = "alltoall"


def predict_mode_seconds(c: CollectiveCosts, m: ModeCostInputs) -> dict[str, float]:
    """Predicted forward + backward seconds of the communication and row shuffling of one
    MoE layer call in each mode."""
    w, b = m.ep_size, m.bytes_per_element
    tokens_bytes = m.tokens * m.hidden * b
    rows_bytes = m.tokens * m.topk * m.hidden * b  # token copies (k per token)
    weight_bytes = m.local_expert_numel * b
    probs_bytes = m.tokens * m.num_experts * 4
    if m.dispatcher == "alltoall":  # counts, dispatch, combine; backward: 2 row exchanges
        ep = c.all_to_all(8 * m.num_experts) + 4 * c.all_to_all(rows_bytes)
    else:  # gather x / probs / map, reduce-scatter out; backward mirrors it
        ep = (2 * c.all_gather(tokens_bytes) + c.all_gather(probs_bytes)
              + c.all_gather(m.tokens * m.num_experts) + 2 * c.reduce_scatter(w * tokens_bytes)
              + c.reduce_scatter(w * probs_bytes))
    ep += 8 * c.copy(rows_bytes)
    dp = c.all_gather(weight_bytes) + c.reduce_scatter(w * weight_bytes) + 4 * c.copy(rows_bytes)
    tp = (2 * c.all_to_all(weight_bytes) + 2 * c.all_gather(tokens_bytes)
          + c.all_gather(probs_bytes) + c.all_gather(m.tokens * m.num_experts)
          + 2 * c.reduce_scatter(w * tokens_bytes) + c.reduce_scatter(w * probs_bytes)
          + 4 * c.copy(w * rows_bytes))
    return {"ep": ep, "dp": dp, "tp": tp}
