"""Context parallelism: attention over a sequence split across the cp group (Megatron's).

Layout (Megatron's load balancing for causal attention, parallel/cp_layout.py): the
sequence is cut into 2 x CP chunks of c = S / (2 CP) tokens; cp rank r holds chunks r and
2CP-1-r, in that order, so every rank has the same share of the causal work.

`cp_attention(q, k, v, ...)` is exact attention of the local queries against the keys and
values of the whole sequence, causal and optionally within documents (per-token document
ids), without ever holding the whole sequence's K/V at once (p2p) or holding it only for
the op (allgather):
K and V travel as one buffer, concatenated along the head dim ([B, G, S/CP, Dk + Dv]) and
split back where a block is used, so their head dims may differ (MLA: K has qk + pe
channels, V v channels) without padding bytes on the wire; dK/dV travel the same way.
- `p2p` (Megatron's default `--cp-comm-type p2p`): K/V go around the cp ring; at each of
  the CP steps a rank sends the block it holds to rank r+1 and receives the next from
  rank r-1 in one `batch_isend_irecv` (even ranks send first, odd ranks receive first,
  so the two sides of each pair post in matching order, as NCCL needs), issued before
  the block's attention is computed so the transfer overlaps the compute. Blocks merge
  by their log-sum-exp (online softmax). Backward runs the ring again: the next K/V
  block is fetched under each block's compute, and each block's dK/dV, accumulated by
  the ranks it has visited, follows it one step behind (a second batched send/recv per
  step, same order on every rank), so after CP steps every rank holds its own complete
  dK/dV (Megatron's / ring-flash-attention's scheme). Only q, k, v, the output and the
  log-sum-exp are kept for backward: scores are recomputed per block.
- `allgather`: K/V of the whole sequence are all-gathered for the op (and freed after);
  backward reduce-scatters dK/dV (summed in fp32, as the ring's).
- `a2a` (Ulysses): parallel/cp_a2a.py trades the sequence split for a head split with
  all-to-alls and runs one attention over the whole sequence.
Each block is one call of PyTorch's SDPA kernels that return the log-sum-exp (flash on
CUDA bf16/fp16, memory-efficient on CUDA fp32 and MLA's unequal head dims, the CPU flash
op here) on the part of the block the causal layout makes visible (cp_layout.block_plan:
the own block causal, an earlier rank's first chunk or a later rank's keys for the second
query chunk fully visible), so no [Sq, Sk] scores are ever held; the backward runs the
kernels' backward ops with the final output and log-sum-exp. Document masks and dropout
need a per-pair mask the kernels cannot take: such calls form each block's scores
explicitly in fp32 ([B, heads, 2c, 2c], per block, never per sequence). Both:
parallel/cp_blocks.py.

Attention dropout (`dropout_p`, training): each block's keep-mask is drawn from the
device generator (the caller's dropout stream) when the block's forward runs, after noting
the generator's state; the recomputing backward draws it again from that state. Dropout
applies to the block's probabilities normalised by its own log-sum-exp, so the merge gives
exactly dropout(softmax(scores)) V over the whole sequence; the backward's delta =
rowsum(dout * out) is unchanged by dropout (FlashAttention's identity).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.parallel.comm import Group, all_gather_no_grad, group_rank, group_size
from megamoe.parallel.cp_a2a import a2a_attention
from megamoe.parallel.cp_blocks import (
    acc_dtype,
    choose_kernel,
    explicit_backward,
    explicit_forward,
    kernel_backward,
    kernel_forward,
)
from megamoe.parallel.cp_layout import block_plan, causal_mask, cp_positions

CP_COMM_TYPES = ("p2p", "allgather", "a2a")
NOT_BUILT_COMM_TYPES = ("a2a+p2p",)


def parse_cp_comm_type(values: list[str], num_layers: int) -> list[str]:
    """`--cp-comm-type` as Megatron parses it: one value for every layer or one per layer."""
    if len(values) not in (1, num_layers):
        raise ValueError(f"--cp-comm-type: give one value or one per layer ({num_layers}), "
                         f"got {len(values)}")
    for v in values:
        if v in NOT_BUILT_COMM_TYPES:
            raise ValueError(f"not supported yet: --cp-comm-type {v}")
        if v not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type: unknown value {v!r} (p2p, allgather, a2a, "
                             "a2a+p2p)")
    return list(values) * num_layers if len(values) == 1 else list(values)


def cp_masked_mean(loss_BS: torch.Tensor, mask_BS: torch.Tensor, group: Group,
                   size: int) -> torch.Tensor:
    """Mean per-token loss over the unmasked tokens of the whole (cp-split) sequence: the
    value is the global mean on every cp rank; the gradient is this rank's tokens' share
    x `size`, since dense gradients are averaged over the cp ranks (dp x cp)."""
    mask = mask_BS.to(torch.float32)
    local_sum = (loss_BS.float() * mask).sum()
    stats = torch.stack([local_sum.detach(), mask.sum()])
    dist.all_reduce(stats, group=group)
    total = stats[1].clamp(min=1.0)
    for_grad = local_sum * size / total
    return for_grad + (stats[0] / total - for_grad.detach())  # value: the global mean


class _Dropout:
    """Keep-masks (scaled by 1 / (1 - p)) of one call's blocks, reproducible in backward:
    `forward_keep` notes the device generator's state and draws; `backward_keep` draws
    again from that state, leaving the generator as it was."""

    def __init__(self, p: float):
        self.p, self.states = p, []

    def _draw(self, shape, device, dtype) -> torch.Tensor:
        return (torch.rand(shape, device=device, dtype=dtype) >= self.p).to(dtype) / (
            1.0 - self.p)

    def forward_keep(self, shape, device, dtype) -> Optional[torch.Tensor]:
        if self.p == 0:
            return None
        self.states.append(_rng_state(device))
        return self._draw(shape, device, dtype)

    def backward_keep(self, i: int, shape, device, dtype) -> Optional[torch.Tensor]:
        if self.p == 0:
            return None
        now = _rng_state(device)
        _set_rng_state(device, self.states[i])
        try:
            return self._draw(shape, device, dtype)
        finally:
            _set_rng_state(device, now)


def _rng_state(device: torch.device) -> torch.Tensor:
    """The generator state of `device` (for CUDA a host copy of seed and offset: no sync)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _merge(out, lse, out_b, lse_b):
    """Online-softmax merge of two partial results over disjoint key sets."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w, w_b = torch.exp(lse - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    return out * w + out_b * w_b, new


class _Ring:
    """Batched send-to-next / receive-from-previous on the cp ring (one buffer); every
    rank issues its batches in the same sequence (tests/parallel/test_cp_attention.py
    checks the order with the pipeline's NCCL order checker)."""

    def __init__(self, group: Group):
        self.group = group
        self.rank, self.size = group_rank(group), group_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, t: torch.Tensor) -> tuple[torch.Tensor, list]:
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group),
               dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        if self.rank % 2:  # as Transformer Engine's ring: odd ranks receive first, so at
            ops.reverse()  # CP = 2 (next = prev) each send meets its receive in order
        return buf, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()


class _Blocks:
    """How one call computes its blocks (parallel/cp_blocks.py): with a kernel on the
    visible part of each block (cp_layout.block_plan: no mask), or explicitly with the
    (document-)causal mask and the dropout keep-masks where the call has document ids or
    dropout (the kernels take neither)."""

    def __init__(self, kernel, q, ids_BS, all_ids, rank, cp, k_dim, scale, drop):
        self.kernel, self.rank, self.cp, self.k_dim = kernel, rank, cp, k_dim
        self.ids, self.all_ids, self.scale, self.drop = ids_BS, all_ids, scale, drop
        self.pos = cp_positions(q.shape[2], rank, cp, q.device)

    def _mask(self, q, src):
        return causal_mask(self.pos, cp_positions(q.shape[2], src, self.cp, q.device),
                           self.ids, None if self.all_ids is None else self.all_ids[src])

    def forward(self, q, blk, src, out, lse):
        """(out, lse) merged with the block of cp rank `src`'s K/V `blk`."""
        k, v = _split(blk, self.k_dim)
        if self.kernel is None:
            keep = self.drop.forward_keep(_scores_shape(q, blk), q.device, acc_dtype(q))
            o_b, l_b = explicit_forward(q, k, v, self._mask(q, src), self.scale, keep)
            return (o_b, l_b) if out is None else _merge(out, lse, o_b, l_b)
        plan = block_plan(self.rank, src, self.cp, q.shape[2])
        kt = plan.k_to
        o_b, l_b = kernel_forward(self.kernel, q[:, :, plan.q_from:], k[:, :, :kt],
                                  v[:, :, :kt], plan.causal, self.scale)
        if out is None:  # the first block is the rank's own: every row
            return o_b, l_b
        rows = slice(plan.q_from, None)
        out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], o_b, l_b)
        return out, lse

    def start_backward(self, dout, out, lse):
        """Keep what every block's backward reads: the final output and lse, dout."""
        self.lse = lse
        if self.kernel is None:
            self.dout = dout.to(out.dtype)
            self.delta = (self.dout * out).sum(-1)
        else:  # the kernels take dout and the output in the model dtype, rows in place
            self.dout, self.out = dout.contiguous(), out.to(dout.dtype)

    def backward(self, i, q, blk, src, dq):
        """Adds the block's dq to `dq`; returns its dK/dV as one `_kv` buffer (fp32)."""
        k, v = _split(blk, self.k_dim)
        if self.kernel is None:
            keep = self.drop.backward_keep(i, _scores_shape(q, blk), q.device, acc_dtype(q))
            dq_b, dk_b, dv_b = explicit_backward(q, k, v, self.lse, self.dout, self.delta,
                                                 self._mask(q, src), self.scale, keep)
            dq += dq_b
            return _kv(dk_b, dv_b)
        plan = block_plan(self.rank, src, self.cp, q.shape[2])
        rows, kt = slice(plan.q_from, None), plan.k_to
        dq_b, dk_b, dv_b = kernel_backward(
            self.kernel, self.dout[:, :, rows], q[:, :, rows], k[:, :, :kt], v[:, :, :kt],
            self.out[:, :, rows], self.lse[:, :, rows], plan.causal, self.scale)
        dq[:, :, rows] += dq_b
        g = _kv(dk_b, dv_b)  # the keys the block did not see get zeros
        return F.pad(g, (0, 0, 0, blk.shape[2] - g.shape[2]))


class _CPAttention(torch.autograd.Function):
    """K and V travel as one buffer [B, G, S/CP, Dk + Dv] (`_kv`), split back by the
    two head dims where a block is used (`_split`), so K and V may differ in width (MLA:
    q/k head dim qk + pe, v head dim v) and no padding is sent; dK/dV likewise."""

    @staticmethod
    def forward(ctx, q, k, v, ids_BS, group, comm_type, scale, dropout_p):
        ring = _Ring(group)
        r, cp = ring.rank, ring.size
        all_ids = (all_gather_no_grad(ids_BS[None], group) if ids_BS is not None else None)
        kernel = choose_kernel(q, k, v, ids_BS is not None or dropout_p > 0)
        drop = _Dropout(dropout_p)
        blocks = _Blocks(kernel, q, ids_BS, all_ids, r, cp, k.shape[-1], scale, drop)
        kv = _kv(k, v)
        if comm_type == "allgather":
            kv_full = all_gather_no_grad(kv[None], group)  # [CP, B, G, Sl, Dk + Dv]
        out = lse = None
        for i in range(cp):
            src = (r - i) % cp
            works = None
            if comm_type == "p2p" and i + 1 < cp:
                nxt, works = ring.start(kv)  # overlaps the block below
            blk = kv if comm_type == "p2p" else kv_full[src]
            out, lse = blocks.forward(q, blk, src, out, lse)
            if works is not None:
                ring.wait(works)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse, ids_BS, all_ids)
        ctx.group, ctx.comm_type, ctx.scale, ctx.drop = group, comm_type, scale, drop
        ctx.kernel = kernel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, ids_BS, all_ids = ctx.saved_tensors
        ring = _Ring(ctx.group)
        r, cp = ring.rank, ring.size
        blocks = _Blocks(ctx.kernel, q, ids_BS, all_ids, r, cp, k.shape[-1], ctx.scale,
                         ctx.drop)
        blocks.start_backward(dout, out, lse)
        dq = torch.zeros_like(q, dtype=out.dtype)
        kv = _kv(k, v)  # travels in the model dtype; blocks upcast on arrival
        if ctx.comm_type == "allgather":
            kv_all = all_gather_no_grad(kv[None], ctx.group)
            dkv_all = torch.zeros_like(kv_all, dtype=out.dtype)  # summed in fp32, as p2p
        dkv = None  # p2p: the gradient of the block held, accumulated by earlier ranks
        for i in range(cp):
            src = (r - i) % cp
            kv_works = None
            if ctx.comm_type == "p2p" and i + 1 < cp:
                kv_next, kv_works = ring.start(kv)  # the next block, under this compute
            blk = kv if ctx.comm_type == "p2p" else kv_all[src]
            g = blocks.backward(i, q, blk, src, dq)
            if ctx.comm_type == "allgather":
                dkv_all[src] += g
                continue
            g = g if dkv is None else g + dkv
            # on to the rank that holds this block next; after the last step it is home
            dkv_next, g_works = ring.start(g)
            if kv_works is not None:
                ring.wait(kv_works)
                kv = kv_next
            ring.wait(g_works)
            dkv = dkv_next
        if ctx.comm_type == "allgather":
            dkv = _reduce_scatter_blocks(dkv_all, ctx.group)
        dk_t, dv_t = _split(dkv, k.shape[-1])
        return (dq.to(q.dtype), dk_t.to(k.dtype), dv_t.to(v.dtype),
                None, None, None, None, None)


def _kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V (or dK and dV) as the one contiguous buffer the ring carries."""
    return torch.cat([k, v], dim=-1)


def _split(kv: torch.Tensor, k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views of a `_kv` buffer, K being the first `k_dim` channels."""
    return kv[..., :k_dim], kv[..., k_dim:]


def _scores_shape(q: torch.Tensor, blk: torch.Tensor) -> tuple[int, int, int, int]:
    """[B, N, Sq, Sk] of one block's scores."""
    return (q.shape[0], q.shape[1], q.shape[2], blk.shape[-2])


def ring_bytes_per_layer(num_query_groups: int, kv_channels: int, tokens_per_rank: float,
                         cp: int, tp: int = 1, dtype_bytes: int = 2,
                         recompute_forward: bool = False,
                         v_channels: Optional[int] = None) -> float:
    """Bytes one cp rank sends per layer in `cp_attention`'s p2p ring for its
    `tokens_per_rank` tokens: the forward passes CP-1 K/V blocks on, the backward CP-1
    K/V blocks again plus CP dK/dV blocks in fp32 (the last one brings each rank its own);
    a recomputed forward adds its ring again. A K/V block holds, per token, the
    `num_query_groups` / TP heads' K (`kv_channels`) and V (`v_channels`, default
    `kv_channels`) channels: MLA passes its heads, qk + pe and v head dims. The planner's
    CP cost uses this."""
    v_channels = kv_channels if v_channels is None else v_channels
    kv = num_query_groups / tp * (kv_channels + v_channels) * tokens_per_rank
    forward = (cp - 1) * kv * dtype_bytes
    return forward * (2 if recompute_forward else 1) + forward + cp * kv * 4


def _reduce_scatter_blocks(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group of [CP, ...] tensors, rank r keeping index r."""
    out = torch.empty_like(x[0])
    dist.reduce_scatter_tensor(out, x.flatten(0, 1).contiguous(), group=group)
    return out


def cp_attention(q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSV: torch.Tensor,
                 group: Group, comm_type: str = "p2p",
                 document_ids_BS: Optional[torch.Tensor] = None,
                 scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal (and, with `document_ids_BS`, document-causal) attention of this cp rank's
    queries [B, N, S/CP, D] against the whole sequence's keys [B, G, S/CP, D] and values
    [B, G, S/CP, V] (V may differ from D, as MLA's), given as this rank's part in the
    `split_for_cp` layout; returns [B, N, S/CP, V]. `scale`: the softmax scale (default
    1/sqrt(D)); `dropout_p`: attention dropout, drawn from the current device generator.
    `comm_type` a2a: parallel/cp_a2a.py (heads exchanged for the sequence)."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"not supported yet: --cp-comm-type {comm_type}")
    scale = 1.0 / math.sqrt(q_BNSD.shape[-1]) if scale is None else scale
    if group_size(group) == 1:  # one rank: its one block is the whole sequence
        mask = causal_mask(*(torch.arange(q_BNSD.shape[2], device=q_BNSD.device),) * 2,
                           document_ids_BS, document_ids_BS)
        return torch.nn.functional.scaled_dot_product_attention(
            q_BNSD, k_BGSD, v_BGSV, attn_mask=mask, scale=scale, dropout_p=dropout_p,
            enable_gqa=k_BGSD.shape[1] != q_BNSD.shape[1])
    ids = None if document_ids_BS is None else document_ids_BS.contiguous()
    if comm_type == "a2a":
        return a2a_attention(q_BNSD, k_BGSD, v_BGSV, group, ids, scale, dropout_p)
    return _CPAttention.apply(q_BNSD, k_BGSD.contiguous(), v_BGSV.contiguous(), ids, group,
                              comm_type, scale, dropout_p)
