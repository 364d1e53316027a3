"""FP8 primary weights (--fp8-param-gather; Megatron's fp8_param, Transformer Engine's FP8
model weights).

With the flag, each weight the FP8 policy quantises (model/fp8/policy.py: the dense linears'
`weight`, the experts' `fc1_weight` / `fc2_weight`) is held in FP8 only: its values live
as E4M3 bytes in the distributed optimizer's parameter buffer
(training/optim/fp8_shards.py), with one scale per tensor (per local expert for the
experts' [E, K, M] weights). The optimizer quantises its fp32 main shard straight into
that buffer after each step and all-gathers the bytes (1 per value, half of bf16's), and
the GEMMs read them as they are: the forward does not quantise the weight again.

The `nn.Parameter` keeps its shape and dtype, so autograd, gradient hooks, names and
checkpoints see the same parameter as without the flag, but it holds no values: its data
is one element broadcast to the shape (`release`). Whoever needs the values reads
`value(p)`, the dequantised weight, which is what the FP8 GEMMs compute with
(checkpoints, weight hashes, the save-time finiteness check); a checkpoint load gives the
parameters real storage for its duration (`materialize`).

Scales follow Transformer Engine's `cast_master_weights_to_fp8`: tensorwise, the amax of
the whole fp32 main weight (max-reduced over the ranks holding its pieces) gives
scale = fp8_max / amax; delayed, the weight's current delayed scale is used and the
shard's amax is recorded into its amax history (reduced with the others at the step's
update, policy.Fp8State).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from megamoe.model.fp8.block_linear import primary_blocks
from megamoe.model.fp8.scaling import Fp8Meta


@dataclass(eq=False)
class Fp8Primary:
    """The FP8 storage of one weight of `shape`: `meta` is its GEMM's weight scaling. Its
    scales: one per weight, or per leading slice (`lead`: the local experts of an
    [E, K, M] weight), each split in `block` x `block` tiles of its last two dims under
    blockwise (128; 0: none). `data` (FP8, the weight's shape, a view of the optimizer's
    buffer) and `scale` ([num_scales] fp32, x ~= data / scale) are set by the optimizer."""

    meta: Fp8Meta
    shape: tuple[int, ...]
    lead: int = 1
    block: int = 0
    data: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None

    def grid(self) -> tuple[int, int, int]:
        """(slices, tile rows, tile columns) of the scales."""
        if not self.block:
            return self.lead, 1, 1
        r, c = self.shape[-2:]
        return self.lead, -(-r // self.block), -(-c // self.block)

    @property
    def num_scales(self) -> int:
        e, r, c = self.grid()
        return e * r * c

    def scale_index(self, pos: torch.Tensor) -> torch.Tensor:
        """The scale of each flat element position `pos` (int64) of the weight."""
        per = math.prod(self.shape) // self.lead
        e, rem = pos // per, pos % per
        if not self.block:
            return e
        cols = self.shape[-1]
        _, nr, nc = self.grid()
        return (e * nr + rem // cols // self.block) * nc + rem % cols // self.block

    def operand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 weight, scales [num_scales]): what the GEMM reads in place of quantising
        the weight."""
        if self.data is None or self.scale is None:
            raise RuntimeError("an FP8 primary weight was used before the distributed "
                               "optimizer quantised it (--fp8-param-gather)")
        return self.data, self.scale

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's values (q / scale of each element) in `dtype`."""
        q, s = self.operand()
        if not self.block:
            return (q.float().reshape(self.lead, -1) / s.view(self.lead, 1)
                    ).reshape(q.shape).to(dtype)
        # the GEMMs' own operands (block_linear.primary_blocks), per leading slice
        r, c = self.shape[-2:]
        slices = zip(q.reshape(self.lead, r, c), s.chunk(self.lead))
        return torch.stack([primary_blocks(q_e, s_e).dequantize() for q_e, s_e in slices]
                           ).reshape(q.shape).to(dtype)


def primary(p: torch.Tensor) -> Optional[Fp8Primary]:
    return getattr(p, "fp8_primary", None)


def value(p: torch.Tensor) -> torch.Tensor:
    """A parameter's values: the dequantised FP8 weight for an FP8 primary weight once the
    optimizer holds it, else `p` itself."""
    prim = primary(p)
    if prim is None or prim.data is None:
        return p
    return prim.dequantized(p.dtype)


def release(p: nn.Parameter) -> None:
    """Drop the high-precision storage of an FP8 primary weight: one element broadcast to
    its shape (writing to it fails loudly; reads go through `value`)."""
    p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)


def released(p: torch.Tensor) -> bool:
    """Whether `release` dropped `p`'s storage (one element for the whole shape)."""
    return p.numel() > 1 and p.untyped_storage().nbytes() <= p.element_size()


def materialize(p: nn.Parameter) -> None:
    """Give an FP8 primary weight real storage holding its values (a checkpoint load
    writes into it; the optimizer then quantises and `release`s it)."""
    p.data = value(p).detach().clone().contiguous()
