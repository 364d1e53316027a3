"""Tensor-parallel layers (Megatron's Column/RowParallelLinear, VocabParallelEmbedding) and
vocab-parallel cross entropy.

Layout-independent initialisation: every layer draws the *full* weight with exactly the
RNG calls the single-process layer (`megamoe.parallel.linear`) makes, then keeps its slice.
So for one seed, the shards of any TP layout are slices of the single-process weights and
the RNG stream stays aligned for the layers built afterwards.

Parameter attributes read by the gradient reducer and the grad-norm:
- `tensor_model_parallel = True`: sharded over TP (each rank owns a disjoint slice).
- `sequence_parallel = True`: replicated over TP but fed by this rank's sequence shard
  only, so its gradient is partial and must be summed over TP (norms, row-parallel biases,
  position embeddings under sequence parallelism).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megamoe.config.tp_comm_overlap import TPCommOverlap
from megamoe.parallel.collective_matmul import ColumnSP, RowSP
from megamoe.parallel.comm import (
    all_gather_no_grad,
    all_reduce_tensor,
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)
from megamoe.parallel.rng import RNGTracker


@dataclass(frozen=True)
class TensorParallel:
    """What a layer needs to know about tensor parallelism (no group = one rank)."""

    group: Optional[dist.ProcessGroup] = None
    sequence_parallel: bool = False
    rng: Optional[RNGTracker] = None  # per-TP-rank dropout stream (parallel/rng.py)
    # --tp-comm-overlap: the linears' collectives overlap their GEMMs under SP
    # (parallel/collective_matmul.py); None: plain collectives
    overlap: Optional[TPCommOverlap] = None

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def sp(self) -> bool:
        """Sequence parallelism actually active (meaningless with one rank)."""
        return self.sequence_parallel and self.group is not None

    @property
    def comm_overlap(self) -> Optional[TPCommOverlap]:
        """The overlap the SP linears run (only under SP with more than one rank)."""
        if self.overlap is None:  # (flag off: nothing more is asked per forward)
            return None
        return self.overlap if self.sp and self.size > 1 else None

    def dropout_rng(self, split: bool) -> ContextManager:
        """RNG context for dropout on activations that are `split` over TP (local heads,
        sequence shards): this rank's own stream; replicated activations keep the default
        stream, identical on every TP rank."""
        if split and self.rng is not None and self.group is not None:
            return self.rng.fork()
        return contextlib.nullcontext()


SINGLE = TensorParallel()


def mark_sequence_parallel(module: nn.Module, tp: TensorParallel) -> nn.Module:
    """Tag `module`'s parameters as TP-replicated with partial (sequence-shard) gradients."""
    if tp.sp:
        for p in module.parameters():
            p.sequence_parallel = True
    return module


def mark_tp_partial(module: nn.Module, tp: TensorParallel) -> nn.Module:
    """Tag `module`'s TP-replicated parameters whose gradient each rank computes from its
    own heads only (--qk-layernorm, Megatron's finalize_model_grads sums them over TP):
    the gradient reduction sums them over TP like the sequence-parallel ones."""
    if tp.group is not None:
        for p in module.parameters():
            p.sequence_parallel = True
    return module


def shard_rows(full: torch.Tensor, blocks: Sequence[int], size: int, rank: int) -> torch.Tensor:
    """Rows of `full` split into consecutive `blocks`; keep chunk `rank` of each block."""
    if size == 1:
        return full
    parts = []
    for block in full.split(list(blocks), dim=0):
        if block.shape[0] % size:
            raise ValueError(f"block of {block.shape[0]} rows is not divisible by the "
                             f"tensor-parallel size {size}")
        parts.append(block.chunk(size, dim=0)[rank])
    return torch.cat(parts).contiguous()


def _full_normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
    """A construction-time weight: on the device the model is being built on (meta when
    built for materialisation, training/materialize.py)."""
    full = torch.empty(shape, device=torch.get_default_device())
    nn.init.normal_(full, mean=0.0, std=std)  # the same draw as megamoe.parallel.linear
    return full


def _check_no_fp8(layer: nn.Module) -> None:
    """The CLI refuses --tp-comm-overlap with --fp8-format; a library caller gets this."""
    if layer.fp8 is not None:
        raise ValueError("not supported yet: --tp-comm-overlap with --fp8-format (the "
                         "collective matmul runs high-precision GEMMs)")


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T (+ b_local): output features split over TP.

    `blocks` partitions the output rows (e.g. q/k/v or gate/up); each block is split
    separately, so rank r holds head-group / gate-up slices r of every block. The input
    enters the TP region: all-gathered from sequence shards with SP, else replicated.
    Built whole (the single-process layer's draws); `shard(tp)` keeps this rank's rows.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, init_std: float,
                 tp: TensorParallel = SINGLE, blocks: Optional[Sequence[int]] = None):
        super().__init__()
        self.tp = SINGLE
        self.blocks = list(blocks) if blocks is not None else [out_features]
        if sum(self.blocks) != out_features:
            raise ValueError(f"blocks {self.blocks} do not add up to {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.init_stds = {"weight": init_std}  # (what a meta-built model draws)
        self.weight = nn.Parameter(_full_normal((out_features, in_features), init_std))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.fp8 = None  # an FP8 GEMM (x, W, b) -> y set by the FP8 policy (model/fp8/)
        self.shard(tp)

    @property
    def local_blocks(self) -> list[int]:
        """This rank's rows of each block (the split of its output features)."""
        return [b // self.tp.size for b in self.blocks]

    @torch.no_grad()
    def shard(self, tp: TensorParallel) -> None:
        """Keep this TP rank's rows of every block (the layer must still be whole)."""
        if self.tp.size != 1:
            raise ValueError("ColumnParallelLinear is already sharded")
        self.tp = tp
        if tp.size > 1:
            self.weight = nn.Parameter(shard_rows(self.weight, self.blocks, tp.size, tp.rank))
            if self.bias is not None:
                self.bias = nn.Parameter(shard_rows(self.bias, self.blocks, tp.size, tp.rank))
        for p in self.parameters():
            p.tensor_model_parallel = tp.size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        overlap = self.tp.comm_overlap
        if overlap is not None:
            _check_no_fp8(self)
            return ColumnSP.apply(x, self.weight, self.bias, self.tp.group, overlap)
        if self.tp.sp:
            x = gather_from_sequence(x, self.tp.group)  # [S/TP, B, H] -> [S, B, H]
        else:
            x = copy_to_tp(x, self.tp.group)
        if self.fp8 is not None:
            return self.fp8(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local "
                f"{self.weight.shape[0]}), bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """y = sum_r x_r @ W_r^T (+ b): input features split over TP, the input already split
    (the output of a ColumnParallelLinear). Partial outputs are all-reduced, or
    reduce-scattered to sequence shards with SP; the replicated bias is added after."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, init_std: float,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = SINGLE
        self.in_features, self.out_features = in_features, out_features
        self.init_stds = {"weight": init_std}  # (what a meta-built model draws)
        self.weight = nn.Parameter(_full_normal((out_features, in_features), init_std))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.fp8 = None  # an FP8 GEMM (x, W, b) -> y set by the FP8 policy (model/fp8/)
        self.shard(tp)

    @torch.no_grad()
    def shard(self, tp: TensorParallel) -> None:
        """Keep this TP rank's input columns (the layer must still be whole)."""
        if self.tp.size != 1:
            raise ValueError("RowParallelLinear is already sharded")
        if self.in_features % tp.size:
            raise ValueError(f"input features {self.in_features} are not divisible by the "
                             f"tensor-parallel size {tp.size}")
        self.tp = tp
        if tp.size > 1:
            self.weight = nn.Parameter(
                self.weight.chunk(tp.size, dim=1)[tp.rank].contiguous())
        self.weight.tensor_model_parallel = tp.size > 1
        if self.bias is not None and tp.sp:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        overlap = self.tp.comm_overlap
        if overlap is not None:
            _check_no_fp8(self)
            y = RowSP.apply(x, self.weight, self.tp.group, overlap)
            return y if self.bias is None else y + self.bias
        y = F.linear(x, self.weight) if self.fp8 is None else self.fp8(x, self.weight, None)
        y = (reduce_scatter_to_sequence(y, self.tp.group) if self.tp.sp
             else reduce_from_tp(y, self.tp.group))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), "
                f"out={self.out_features}, bias={self.bias is not None}")


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over TP. Returns this rank's *partial* lookup (zeros for ids
    outside its rows): the caller sums over TP (all-reduce, or reduce-scatter with SP)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = SINGLE
        self.num_embeddings = num_embeddings
        self.per_rank, self.vocab_start = num_embeddings, 0
        self.init_stds = {"weight": init_std}
        self.weight = nn.Parameter(_full_normal((num_embeddings, embedding_dim), init_std))
        self.shard(tp)

    @torch.no_grad()
    def shard(self, tp: TensorParallel) -> None:
        """Keep this TP rank's range of rows (the table must still be whole)."""
        if self.tp.size != 1:
            raise ValueError("VocabParallelEmbedding is already sharded")
        if self.num_embeddings % tp.size:
            raise ValueError(f"padded vocabulary {self.num_embeddings} is not divisible by "
                             f"the tensor-parallel size {tp.size}")
        self.tp = tp
        self.per_rank = self.num_embeddings // tp.size
        self.vocab_start = tp.rank * self.per_rank
        if tp.size > 1:  # a copy: the whole table must not stay alive behind a view
            rows = slice(self.vocab_start, self.vocab_start + self.per_rank)
            self.weight = nn.Parameter(self.weight[rows].clone())
        self.weight.tensor_model_parallel = tp.size > 1

    def forward(self, ids: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`weight`: a table of this rank's rows to use instead of the module's (the last
        pipeline stage's copy of the word embedding, for MTP)."""
        weight = self.weight if weight is None else weight
        if self.tp.size == 1:
            return F.embedding(ids, weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (local {self.per_rank}), {self.weight.shape[1]}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits whose vocabulary is split over TP (Megatron's algorithm):
    only [tokens] statistics (max, target logit, sum of exp) cross ranks."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits = logits.float()
        width = logits.shape[-1]
        local_max = (logits.max(dim=-1).values if width else
                     logits.new_full(logits.shape[:-1], float("-inf")))
        all_reduce_tensor(local_max, group, dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        local_t = target - vocab_start
        outside = (local_t < 0) | (local_t >= width)
        local_t = local_t.masked_fill(outside, 0)
        if width:
            picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        else:
            picked = torch.zeros_like(local_max)
        picked = picked.masked_fill(outside, 0.0)
        all_reduce_tensor(picked, group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce_tensor(sum_exp, group)
        loss = sum_exp.log() - picked
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[-1]:
            grad.scatter_add_(-1, local_t.unsqueeze(-1),
                              -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, target: torch.Tensor,
                                 vocab_start: int, group: Optional[dist.ProcessGroup]
                                 ) -> torch.Tensor:
    """Per-token loss [...] (fp32) from this rank's logits [..., V_local] covering vocabulary
    ids [vocab_start, vocab_start + V_local). Local widths may differ (padded rows are
    excluded by the caller); full-vocabulary logits are never gathered."""
    return _VocabParallelCrossEntropy.apply(logits_local, target, vocab_start, group)


def gather_vocab_logits(logits_local: torch.Tensor, vocab_size: int, per_rank: int,
                        group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Forward-only (inference): full logits [..., vocab_size] from uneven local slices."""
    if group is None:
        return logits_local
    pad = per_rank - logits_local.shape[-1]
    padded = F.pad(logits_local.detach(), (0, pad))
    gathered = all_gather_no_grad(padded.unsqueeze(0), group)  # [TP, ..., per_rank]
    return torch.cat(gathered.unbind(0), dim=-1)[..., :vocab_size]
