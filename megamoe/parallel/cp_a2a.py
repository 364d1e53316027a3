"""`--cp-comm-type a2a`: context-parallel attention by all-to-all (DeepSpeed-Ulysses; what
Megatron's `a2a` runs through Transformer Engine).

Each cp rank holds its two load-balanced chunks (r and 2CP-1-r, parallel/cp_layout.py)
of every head. One all-to-all per tensor trades that for the whole sequence of 1/CP of the
heads: rank j receives heads [j N/CP, (j+1) N/CP) of every rank's chunks, which it puts in
sequence order, and runs ordinary causal (or document-causal) attention over the whole
sequence, on whichever fused kernel SDPA picks; a last all-to-all sends each rank's
output back as its chunks of all heads. The all-to-alls are differentiable (their
backward is the reverse exchange), so autograd gives dq, dk, dv with nothing recomputed.

Compared with the p2p ring it moves q, k, v and the output once each (forward and
backward), (CP-1)/CP of each, whatever the sequence length, and the attention is one
kernel call over the whole sequence; it needs the heads per TP rank, and the K/V groups
(GQA), to split evenly over the cp ranks, as Transformer Engine's.
"""

from __future__ import annotations

from typing import Optional

import torch

from megamoe.parallel.comm import Group, all_gather_no_grad, all_to_all_uneven, group_size
from megamoe.parallel.cp_layout import causal_mask, join_from_cp, split_for_cp


def _heads_to_ranks(x_BHSD: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's chunks of all heads [B, H, 2c, D] -> 1/CP of the heads over the whole
    sequence [B, H/CP, S, D]."""
    cp = group_size(group)
    b, h, s, d = x_BHSD.shape
    send = x_BHSD.view(b, cp, h // cp, s, d).transpose(0, 1)  # [CP (dest), B, H/CP, 2c, D]
    recv = all_to_all_uneven(send.contiguous().view(cp * b, h // cp, s, d), [b] * cp,
                             [b] * cp, group)
    return join_from_cp(list(recv.view(cp, b, h // cp, s, d).unbind(0)), dim=2)


def _ranks_to_heads(o_BHSV: torch.Tensor, group: Group) -> torch.Tensor:
    """Inverse of `_heads_to_ranks` for the output: [B, N/CP, S, V] -> [B, N, 2c, V]."""
    cp = group_size(group)
    send = torch.stack([split_for_cp(o_BHSV, j, cp, dim=2)  # [CP (dest), B, N/CP, 2c, V]
                        for j in range(cp)])
    _, b, h, s, v = send.shape
    recv = all_to_all_uneven(send.reshape(cp * b, h, s, v), [b] * cp, [b] * cp, group)
    return recv.view(cp, b, h, s, v).transpose(0, 1).reshape(b, cp * h, s, v)


def a2a_bytes_per_layer(num_heads: int, num_kv_heads: int, k_channels: int, v_channels: int,
                        tokens_per_rank: float, cp: int, tp: int = 1, dtype_bytes: int = 2,
                        recompute_forward: bool = False) -> float:
    """Bytes one cp rank sends per layer in `a2a_attention` for its `tokens_per_rank`
    tokens: the forward's all-to-alls move q (num_heads x k_channels per token), k
    (num_kv_heads x k_channels), v (num_kv_heads x v_channels) and the output (num_heads x
    v_channels), heads split over TP, each keeping 1/CP at home; the backward moves their
    gradients the same way; a recomputed forward moves its four again. The planner's CP
    cost for a2a layouts uses this."""
    per_token = (num_heads * (k_channels + v_channels)
                 + num_kv_heads * (k_channels + v_channels)) / tp
    forward = per_token * tokens_per_rank * (cp - 1) / cp * dtype_bytes
    return forward * (2 if recompute_forward else 1) + forward


def a2a_attention(q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSV: torch.Tensor,
                  group: Group, document_ids_BS: Optional[torch.Tensor] = None,
                  scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """`cp_attention` for `--cp-comm-type a2a`: the same inputs and result (this rank's
    chunks, [B, N, 2c, V]); N and G must be multiples of the cp size."""
    cp = group_size(group)
    n, g = q_BNSD.shape[1], k_BGSD.shape[1]
    if n % cp or g % cp:
        raise ValueError(f"--cp-comm-type a2a: {n} query heads and {g} key/value heads per "
                         f"tensor-parallel rank must be multiples of --context-parallel-size "
                         f"({cp})")
    q, k, v = (_heads_to_ranks(t, group) for t in (q_BNSD, k_BGSD, v_BGSV))
    mask = None
    if document_ids_BS is not None:
        ids = join_from_cp(list(all_gather_no_grad(document_ids_BS[None], group).unbind(0)),
                           dim=1)
        pos = torch.arange(ids.shape[1], device=ids.device)
        mask = causal_mask(pos, pos, ids, ids)
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, dropout_p=dropout_p,
        enable_gqa=g != n)
    return _ranks_to_heads(o, group)
