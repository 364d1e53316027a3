"""The distributed optimizer's buffers of FP8 primary weights (--fp8-param-gather;
Megatron's param buffers of FP8 parameters, Transformer Engine's cast_master_weights_to_fp8).

An `Fp8FlatShards` lays its weights out as FlatShards does, but its param buffer holds FP8
bytes (uint8, 1 per value): each weight's `Fp8Primary.data` (model/fp8/params.py) is an
FP8 view of its range, and the parameter itself keeps no values (`release`). The fp32
main shard is always separate (the FP8 bytes are not the weights' exact values), so it is
saved in checkpoints whatever the model dtype.

After each step, `start_all_gather_params` quantises this rank's main shard into its own
slice of the buffer and all-gathers the bytes. The scales, per weight (per local expert
for an [E, K, M] expert weight):
- tensorwise: amax of each fp32 main weight, this rank's pieces max-reduced over the shard
  group (one all-reduce per buffer), scale = fp8_max / amax (quantize.current_scale), so
  every rank holds every scale and only bytes are gathered;
- delayed: the weight's current delayed scale (Fp8Meta.scale); the weight's amax, reduced
  over the shard group as tensorwise's, goes into the current amax-history slot (which
  the step's update reduces over the amax group). Reducing here, as TE does, keeps the
  scales of a weight equal on the ranks that gather its bytes even when the amax group
  leaves DP out (--tp-only-amax-red);
- blockwise: one power-of-2 scale per 128x128 block of each weight (of each expert's
  [K, M]), from the block's amax over the pieces that cross it, max-reduced as
  tensorwise's (TE's fp8_block_scaling_compute_partial_amax / partial_cast).
Each element finds its scale by its position (Fp8Primary.scale_index), in chunks.
Quantising from the fp32 main rather than a bf16 copy is TE's choice (TE >= 2.2); in an
fp32 model the FP8 weights are then exactly those the forward would have quantised.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megamoe.model.fp8.blocks import pow2_scale
from megamoe.model.fp8.params import materialize, primary, release, released
from megamoe.model.fp8.quantize import current_scale, quantize
from megamoe.training.optim.flat_shards import FlatShards, Piece, all_gather

CHUNK = 1 << 22  # elements per pass of the cast


class Fp8FlatShards(FlatShards):
    """FlatShards of FP8 primary weights (all of one dtype and shard group)."""

    def _install_params(self) -> torch.Tensor:
        first = self.params[0][1]
        self.separate_main = True
        self.param_buffer = torch.zeros(self.numel, dtype=torch.uint8, device=first.device)
        main = torch.zeros(self.shard_numel, dtype=torch.float32, device=first.device)
        hi = self.lo + self.shard_numel
        self.scale_offsets: list[int] = []
        scales = 0
        for (_, p), off in zip(self.params, self.offsets):
            a, b = max(self.lo, off), min(hi, off + p.numel())
            if a < b:
                main[a - self.lo:b - self.lo].copy_(p.detach().reshape(-1)[a - off:b - off])
            prim = primary(p)
            prim.data = (self.param_buffer[off:off + p.numel()].view(prim.meta.dtype)
                         .view(p.shape))
            self.scale_offsets.append(scales)
            scales += prim.num_scales
            release(p)
        self.num_scales = scales
        return main

    def piece_values(self, piece: Piece) -> torch.Tensor:
        """A piece's values in its materialised parameter (checkpoint loads only)."""
        if released(piece.param):
            raise RuntimeError("an FP8 primary weight was read without its values "
                               "(model/fp8/params.py materialize)")
        return piece.param.detach().reshape(-1)[piece.start:piece.end]

    def main_from_params(self) -> None:
        for piece in self.pieces:
            piece.main.copy_(self.piece_values(piece))

    def _chunks(self, k: int, piece: Piece) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(scale index within the buffer of each element, start, end in piece.main) per
        chunk of a piece (chunks bound the index tensor, 8 bytes per element)."""
        prim, n = primary(piece.param), piece.end - piece.start
        for a in range(0, n, CHUNK):
            b = min(a + CHUNK, n)
            pos = torch.arange(piece.start + a, piece.start + b, device=piece.main.device)
            yield self.scale_offsets[k] + prim.scale_index(pos), a, b

    def _scales(self) -> torch.Tensor:
        """Every weight's scales [num_scales] (module doc), this rank's piece amaxes
        recorded under delayed scaling."""
        device = self.param_buffer.device
        amax = torch.zeros(self.num_scales, dtype=torch.float32, device=device)
        for k, piece in self.piece_at.items():
            for index, a, b in self._chunks(k, piece):
                amax.scatter_reduce_(0, index, piece.main[a:b].abs(), "amax")
        metas = [primary(p).meta for _, p in self.params]
        if self.size > 1:  # each weight's amax over its pieces (TE reduces over DP here)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        if metas[0].delayed:  # each meta records the amaxes, returns its scales
            return torch.cat([meta.scale_for(amax[lo:lo + primary(p).num_scales])
                              for (_, p), lo, meta in zip(self.params, self.scale_offsets,
                                                          metas)])
        if metas[0].recipe == "blockwise":  # power-of-2 block scales, as the forward's
            return pow2_scale(amax, metas[0].fp8_max)
        return current_scale(amax, metas[0].fp8_max)

    @torch.no_grad()
    def cast(self) -> None:
        """Quantise this rank's main shard into its slice of the FP8 buffer and give every
        weight its new scales (collective over the shard group)."""
        scales = self._scales()
        own = self.param_buffer.view(primary(self.params[0][1]).meta.dtype)
        for k, piece in self.piece_at.items():
            dtype, lo = primary(piece.param).meta.dtype, self.lo + piece.shard_offset
            for index, a, b in self._chunks(k, piece):
                own[lo + a:lo + b].copy_(quantize(piece.main[a:b], scales[index], dtype))
        for (_, p), lo in zip(self.params, self.scale_offsets):
            prim = primary(p)
            prim.scale = scales[lo:lo + prim.num_scales].clone()

    @torch.no_grad()
    def start_all_gather_params(self) -> Optional[dist.Work]:
        self.cast()
        if self.size == 1:
            return None
        own = self.param_buffer[self.lo:self.lo + self.shard_numel]
        return all_gather(self.param_buffer, own, group=self.group, async_op=True)


@contextlib.contextmanager
def fp8_weights_loading(optimizer) -> Iterator[None]:
    """Around a checkpoint load: the FP8 primary weights get real storage holding their
    values (the load writes into them, and a load without optimizer states takes the main
    parameters from them); afterwards the optimizer quantises its main shards again (with
    the FP8 scaling state the load restored) and all-gathers them."""
    buffers = [b for b in getattr(optimizer, "buffers", []) if isinstance(b, Fp8FlatShards)]
    for buf in buffers:
        for _, p in buf.params:
            materialize(p)
    yield
    for buf in buffers:
        buf.all_gather_params()
        for _, p in buf.params:
            release(p)
