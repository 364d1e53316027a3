"""The distributed optimizer's flat buffers (Megatron-Core's param and grad buffers).

One `FlatShards` per shard group (dense parameters: dp; routed experts: edp) and parameter
dtype. Its parameters are laid out back to back in one flat range, padded to a multiple of
the group size; rank r owns the r-th contiguous slice, its shard.

- `param_buffer` (model dtype): the parameters become views of it.
- `grad_buffer` (fp32, same layout): gradients accumulate into it directly. A
  post-accumulate-grad hook adds each parameter's .grad to its view and frees the .grad
  (fp32 and bf16 alike), so accumulation over micro-batches never rounds in bf16 and no
  parameter keeps a .grad of its own. With --main-grads-dtype bf16 (precision-aware
  optimizer, a bf16 model) it is bf16, as Megatron's: accumulated and reduced in bf16.
- `main_shard` (fp32): what AdamW updates. For a bf16 model a separate fp32 copy of the
  shard; for fp32 the param buffer's own shard (AdamW updates the parameters in place).
  Each parameter's part of the shard is a `Piece` whose `main` is a view of it.

reduce_scatter: the grad buffer is the input and its own shard the output (in place: NCCL
and gloo both accept output == input[r * S:(r + 1) * S]), so no gradient is copied.
all_gather_params: the main shard is rounded into the param buffer's own shard, then the
param buffer is all-gathered in place, in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megamoe.parallel.comm import group_rank, group_size

Group = Optional[dist.ProcessGroup]
# torch >= 2.10 names (the *_tensor spellings are deprecated aliases).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Piece:
    """The part of `param` (flat elements [start, end)) inside this rank's shard."""

    param: torch.nn.Parameter
    index: int  # position in the optimizer's model_params
    start: int
    end: int
    shard_offset: int  # where the piece starts inside the rank's shard
    main: torch.Tensor  # view of the fp32 main shard: what AdamW updates
    grad: torch.Tensor  # view of the grad buffer's shard: the reduced gradient


def _accumulate_hook(view: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """Add the parameter's fresh .grad to its grad-buffer view and free it (into an fp32
    view the add upcasts a bf16 gradient element by element: no fp32 copy of it is made)."""
    def hook(param: torch.Tensor) -> None:
        view.add_(param.grad)
        param.grad = None
    return hook


class FlatShards:
    """Flat param / grad buffers of `params` (all of one dtype) sharded over `group`."""

    def __init__(self, params: list[tuple[int, torch.nn.Parameter]], group: Group,
                 expert: bool, grad_dtype: torch.dtype = torch.float32) -> None:
        self.group, self.expert = group, expert
        self.size, self.rank = group_size(group), group_rank(group)
        self.params = params
        self.offsets: list[int] = []
        total = 0
        for _, p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = -(-total // self.size) * self.size  # padded to a multiple of the size
        self.shard_numel = self.numel // self.size
        self.lo = self.rank * self.shard_numel
        first = params[0][1]
        self.grad_buffer = torch.zeros(self.numel, dtype=grad_dtype, device=first.device)
        with torch.no_grad():
            self.main_shard = self._install_params()
            for (_, p), off in zip(params, self.offsets):
                grad = self.grad_buffer[off:off + p.numel()].view(p.shape)
                p.register_post_accumulate_grad_hook(_accumulate_hook(grad))
        self.grad_shard = self.grad_buffer[self.lo:self.lo + self.shard_numel]
        self.pieces: list[Piece] = []
        self.piece_at: dict[int, Piece] = {}  # position in `params` -> this rank's piece
        hi = self.lo + self.shard_numel
        for k, ((index, p), off) in enumerate(zip(params, self.offsets)):
            start, end = max(self.lo, off) - off, min(hi, off + p.numel()) - off
            if start < end:
                so = off + start - self.lo
                piece = Piece(p, index, start, end, so, self.main_shard[so:so + end - start],
                               self.grad_shard[so:so + end - start])
                self.pieces.append(piece)
                self.piece_at[k] = piece

    def _install_params(self) -> torch.Tensor:
        """Make the parameters views of a new flat param buffer of their dtype (holding
        their values); return the fp32 main shard: a copy of this rank's slice, or the
        slice itself for fp32 parameters."""
        first = self.params[0][1]
        self.separate_main = first.dtype != torch.float32
        self.param_buffer = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        for (_, p), off in zip(self.params, self.offsets):
            view = self.param_buffer[off:off + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(p.shape)
        own = self.param_buffer[self.lo:self.lo + self.shard_numel]
        return own.float() if self.separate_main else own  # fp32 copy / view

    def piece_values(self, piece: Piece) -> torch.Tensor:
        """A piece's values in its parameter."""
        return piece.param.detach().reshape(-1)[piece.start:piece.end]

    def main_from_params(self) -> None:
        """The main shard from the parameters' values (a load without optimizer states)."""
        if self.separate_main:
            self.main_shard.copy_(self.param_buffer[self.lo:self.lo + self.shard_numel])

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()

    def reduce_scatter(self, divisor: int) -> None:
        """The grad buffer's own shard becomes sum-over-group(grad buffers) / divisor; the
        rest of the buffer is left undefined (zero_grad clears it)."""
        work = self.start_reduce_scatter()
        if work is not None:
            work.wait()
        self.grad_shard.div_(divisor)

    def start_reduce_scatter(self) -> Optional[dist.Work]:
        """The reduce-scatter of `reduce_scatter`, launched async (its work, None with one
        rank); the caller waits, then divides the grad shard."""
        if self.size == 1:
            return None
        return _reduce_scatter(self.grad_shard, self.grad_buffer, group=self.group,
                               async_op=True)

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Write every rank's updated main shard into the model parameters."""
        work = self.start_all_gather_params()
        if work is not None:
            work.wait()

    @torch.no_grad()
    def start_all_gather_params(self) -> Optional[dist.Work]:
        """`all_gather_params` launched async (its work, None with one rank)."""
        own = self.param_buffer[self.lo:self.lo + self.shard_numel]
        if self.separate_main:
            own.copy_(self.main_shard)  # rounds to the model dtype
        if self.size == 1:
            return None
        return all_gather(self.param_buffer, own, group=self.group, async_op=True)

    def _span(self, k: int) -> tuple[int, int]:
        """Group ranks holding a piece of parameter k: first and last."""
        off, n = self.offsets[k], self.params[k][1].numel()
        return off // self.shard_numel, (off + n - 1) // self.shard_numel

    def owner(self, k: int) -> int:
        """The group rank that saves parameter k: the one holding its first element (so
        a rank assembles at most one parameter per group, the one crossing its shard's
        end)."""
        return self._span(k)[0]

    def gather_to_owner(self, k: int, local: list[torch.Tensor]
                        ) -> Optional[list[torch.Tensor]]:
        """Parameter k's whole flat tensors on its owner, from each holder's pieces
        (`local`: this rank's piece of each, aligned; empty if it holds none); None on
        other ranks. Collective over the ranks holding a piece, one parameter at a time:
        point-to-point sends to the owner, nothing gathered anywhere else."""
        first, last = self._span(k)
        if not local or not first <= self.rank <= last:
            return None
        if first == last:  # the parameter lies in this rank's shard: its pieces are whole
            return [t.reshape(-1) for t in local]
        off, n = self.offsets[k], self.params[k][1].numel()
        ops = []
        if self.rank != first:
            ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=first, tag=j)
                   for j, t in enumerate(local)]
        else:
            whole = [torch.empty(n, dtype=t.dtype, device=t.device) for t in local]
            for w, t in zip(whole, local):
                w[:t.numel()].copy_(t)
            for r in range(first + 1, last + 1):
                a = r * self.shard_numel - off
                b = min(a + self.shard_numel, n)
                ops += [dist.P2POp(dist.irecv, w[a:b], group=self.group, group_peer=r, tag=j)
                        for j, w in enumerate(whole)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return whole if self.rank == first else None
