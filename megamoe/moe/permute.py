"""Sort-based, dropless token permutation.

Rows are grouped expert-major (token order inside each expert) by one `nonzero` over the
transposed [E, T] routing map: O(T*E) booleans and O(N*H) data movement, never a one-hot
[T, E, capacity] tensor. Everything is a gather/index_add, so autograd flows through.

Host synchronisation: the number of rows N = routing_map.sum() is data-dependent, so
grouping the rows costs exactly one device->host sync (the `nonzero`, which must know its
output size before it can allocate it). Everything else is derived from its result by
indexing: the combine weights (`select_probs`), the rows (`index_select`) and the group
sizes (`tokens_per_expert_E`, a sum that stays on the device). The padded layout
(`permute_padded`) has a static size E * capacity and needs no sync at all.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Optional, Sequence

import torch


class ExpertMajorRows(NamedTuple):
    """Row n of the expert-major layout is token token_indices_N[n] for expert
    expert_indices_N[n]; tokens_per_expert_E[e] rows belong to expert e (all on the
    routing map's device)."""

    token_indices_N: torch.Tensor
    expert_indices_N: torch.Tensor
    tokens_per_expert_E: torch.Tensor


def _expert_major(routing_map_TE: torch.Tensor) -> torch.Tensor:
    return routing_map_TE.bool().t().contiguous()  # [E, T]


def expert_major_rows(routing_map_TE: torch.Tensor,
                      chunk_sizes: Optional[Sequence[int]] = None) -> ExpertMajorRows:
    """The (expert, token) pairs of the routing map, expert-major then token order.

    One `nonzero` of the [E, T] map (row-major, so sorted by expert, then token): the one
    device->host sync of the dropless permutation. With `chunk_sizes` (tokens of
    consecutive chunks, as the overlapped all-to-all cuts them) the rows are chunk-major,
    each chunk in its own expert-major layout, still from one `nonzero` (of a [C * E, T]
    map); tokens_per_expert_E is then [C * E], chunk-major."""
    map_ET = _expert_major(routing_map_TE)
    num_experts, num_tokens = map_ET.shape
    if chunk_sizes is not None and len(chunk_sizes) > 1:
        token_T = torch.arange(num_tokens, device=map_ET.device)
        ends = list(itertools.accumulate(chunk_sizes))
        in_chunk_CT = torch.stack([(token_T >= end - size) & (token_T < end)
                                   for size, end in zip(chunk_sizes, ends)])
        map_ET = (map_ET.unsqueeze(0) & in_chunk_CT.unsqueeze(1)).reshape(-1, num_tokens)
    row_N, token_N = map_ET.nonzero().unbind(dim=1)
    return ExpertMajorRows(token_N.contiguous(), row_N % num_experts, map_ET.sum(dim=1))


def select_probs(probs_TE: torch.Tensor, rows: ExpertMajorRows) -> torch.Tensor:
    """probs_N aligned with the rows: probs_TE[token_n, expert_n], by an index_select on
    the flat [T * E] weights (no data-dependent size, so no sync; its backward is an
    index_add of unique positions)."""
    num_experts = probs_TE.shape[1]
    flat_N = rows.token_indices_N * num_experts + rows.expert_indices_N
    return probs_TE.reshape(-1).index_select(0, flat_N)


def permute(x_TH: torch.Tensor, routing_map_TE: torch.Tensor, gather: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group token copies by expert.

    Returns (x_NH, token_indices_N, tokens_per_expert_E) with N = routing_map.sum():
    row n of x_NH is token token_indices_N[n], and the first tokens_per_expert_E[0] rows
    belong to expert 0, and so on. With gather=False x_TH itself is returned for a
    consumer that gathers on the fly (grouped experts fuse it into fc1). The combine
    weights of the same rows: `permute_with_probs` (no second sync).
    """
    x_NH, token_indices_N, _, tokens_per_expert_E = permute_with_probs(
        x_TH, None, routing_map_TE, gather)
    return x_NH, token_indices_N, tokens_per_expert_E


def permute_with_probs(x_TH: torch.Tensor, probs_TE: Optional[torch.Tensor],
                       routing_map_TE: torch.Tensor, gather: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                  torch.Tensor]:
    """permute() plus the combine weight of every row (None without probs_TE):
    (x_NH, token_indices_N, probs_N, tokens_per_expert_E), one device->host sync."""
    rows = expert_major_rows(routing_map_TE)
    x_NH = x_TH.index_select(0, rows.token_indices_N) if gather else x_TH
    probs_N = None if probs_TE is None else select_probs(probs_TE, rows)
    return x_NH, rows.token_indices_N, probs_N, rows.tokens_per_expert_E


def permute_probs(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor) -> torch.Tensor:
    """probs_N aligned with permute()'s rows: the combine weight of each token copy.

    A sync of its own (it re-derives the rows); the dispatchers use permute_with_probs."""
    return select_probs(probs_TE, expert_major_rows(routing_map_TE))


class _Unpermute(torch.autograd.Function):
    """out_TH = index_add of (probs_N *) y_NH over token_indices_N, in fp32 or wider.

    Autograd's index_add keeps its [N, H] source for backward (only for its shape); this
    keeps token_indices_N, plus y_NH and probs_N when the weights need a gradient.
    """

    @staticmethod
    def forward(ctx, y_NH: torch.Tensor, token_indices_N: torch.Tensor,
                probs_N: Optional[torch.Tensor], num_tokens: int) -> torch.Tensor:
        acc = torch.promote_types(y_NH.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        weighted_NH = y_NH.to(acc)
        if probs_N is not None:
            weighted_NH = weighted_NH * probs_N.to(acc).unsqueeze(-1)
        out_TH = weighted_NH.new_zeros(num_tokens, y_NH.shape[-1])
        out_TH.index_add_(0, token_indices_N, weighted_NH)
        keep_y = probs_N is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(token_indices_N, y_NH if keep_y else None, probs_N)
        ctx.acc, ctx.y_dtype = acc, y_NH.dtype
        return out_TH.to(y_NH.dtype)

    @staticmethod
    def backward(ctx, grad_TH: torch.Tensor):
        token_indices_N, y_NH, probs_N = ctx.saved_tensors
        grad_NH = grad_TH.to(ctx.acc).index_select(0, token_indices_N)
        grad_probs = None
        if y_NH is not None:
            grad_probs = (grad_NH * y_NH.to(ctx.acc)).sum(dim=-1).to(probs_N.dtype)
        grad_y = None
        if ctx.needs_input_grad[0]:
            if probs_N is not None:
                grad_NH = grad_NH * probs_N.to(ctx.acc).unsqueeze(-1)
            grad_y = grad_NH.to(ctx.y_dtype)
        return grad_y, None, grad_probs, None


def unpermute(y_NH: torch.Tensor, token_indices_N: torch.Tensor,
              probs_N: Optional[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """out[t] = sum over copies n of token t of probs_N[n] * y_NH[n] (probs_N None: rows
    already weighted, as the grouped experts do before fc2).

    Accumulates in at least fp32 (index_add, deterministic on CPU) and casts back to y's
    dtype, so a bf16 model sums its k expert outputs without extra rounding. Saves no
    [N, H] tensor for backward unless the combine weights need a gradient.
    """
    return _Unpermute.apply(y_NH, token_indices_N, probs_N, num_tokens)


def pad_groups(token_indices_N: torch.Tensor, probs_N: torch.Tensor,
               tokens_per_expert_E: torch.Tensor, capacity: int, pad_index: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every expert group to `capacity` rows (--moe-pad-expert-input-to-capacity).

    Returns (token_indices_P, probs_P) with P = E * capacity; padding rows point at
    `pad_index` (a zero row the caller appends to x) with combine weight 0, so they are
    zero inputs, contribute nothing, and pass no gradient to any token.
    """
    num_experts = tokens_per_expert_E.numel()
    if int(tokens_per_expert_E.max()) > capacity:
        raise ValueError(f"pad_groups: an expert has {int(tokens_per_expert_E.max())} rows, "
                         f"more than the capacity {capacity}")
    device = token_indices_N.device
    starts_E = tokens_per_expert_E.cumsum(0) - tokens_per_expert_E
    expert_N = torch.repeat_interleave(torch.arange(num_experts, device=device),
                                       tokens_per_expert_E, output_size=len(token_indices_N))
    slot_N = torch.arange(len(token_indices_N), device=device) - starts_E[expert_N]
    dest_N = expert_N * capacity + slot_N
    indices_P = torch.full((num_experts * capacity,), pad_index, dtype=token_indices_N.dtype,
                           device=device)
    probs_P = probs_N.new_zeros(num_experts * capacity)
    return indices_P.index_copy(0, dest_N, token_indices_N), probs_P.index_copy(0, dest_N,
                                                                                 probs_N)


def permute_padded(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, capacity: int,
                   pad_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pad_groups(permute...) straight from the routing map, without a host sync.

    Returns (token_indices_P, probs_P), P = E * capacity: expert e owns rows
    [e * capacity, (e + 1) * capacity), its tokens in token order and then padding rows
    (token `pad_index`, weight 0). Every size is static, so nothing waits for the device.
    A copy beyond its expert's capacity (none after apply_capacity) is dropped.
    """
    map_ET = _expert_major(routing_map_TE)
    num_experts, num_tokens = map_ET.shape
    device = map_ET.device
    slot_ET = map_ET.cumsum(dim=1) - 1  # 0-based slot of each copy within its expert
    expert_E1 = torch.arange(num_experts, device=device).unsqueeze(1)
    token_ET = torch.arange(num_tokens, device=device).expand(num_experts, -1)
    size = num_experts * capacity
    # Copies off the map (or over capacity) go to a position of their own past the end,
    # cut off below: the destinations are unique, so index_copy is deterministic.
    dest_ET = torch.where(map_ET & (slot_ET < capacity), expert_E1 * capacity + slot_ET,
                          size + expert_E1 * num_tokens + token_ET)
    dest = dest_ET.reshape(-1)
    total = size + num_experts * num_tokens
    indices_P = torch.full((total,), pad_index, dtype=torch.long, device=device).index_copy(
        0, dest, token_ET.reshape(-1))[:size]
    probs_P = torch.zeros(total, dtype=probs_TE.dtype, device=device).index_copy(
        0, dest, probs_TE.t().reshape(-1))[:size]
    return indices_P, probs_P
