"""Sort-based, dropless token permutation.

Rows are grouped expert-major (token order inside each expert) by selecting on the
transposed routing map: O(T*E) booleans and O(N*H) data movement, never a one-hot
[T, E, capacity] tensor. Everything is a gather/index_add, so autograd flows through.
"""

from __future__ import annotations

from typing import Optional

import torch


def _expert_major(routing_map_TE: torch.Tensor) -> torch.Tensor:
    return routing_map_TE.bool().t().contiguous()  # [E, T]


def permute(x_TH: torch.Tensor, routing_map_TE: torch.Tensor, gather: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group token copies by expert.

    Returns (x_NH, token_indices_N, tokens_per_expert_E) with N = routing_map.sum():
    row n of x_NH is token token_indices_N[n], and the first tokens_per_expert_E[0] rows
    belong to expert 0, and so on. With gather=False x_TH itself is returned for a
    consumer that gathers on the fly (grouped experts fuse it into fc1).
    """
    map_ET = _expert_major(routing_map_TE)
    num_experts, num_tokens = map_ET.shape
    tokens_per_expert_E = map_ET.sum(dim=1)
    token_ids_ET = torch.arange(num_tokens, device=x_TH.device).expand(num_experts, -1)
    token_indices_N = token_ids_ET.masked_select(map_ET)
    x_NH = x_TH.index_select(0, token_indices_N) if gather else x_TH
    return x_NH, token_indices_N, tokens_per_expert_E


def permute_probs(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor) -> torch.Tensor:
    """probs_N aligned with permute()'s rows: the combine weight of each token copy."""
    return probs_TE.t().contiguous().masked_select(_expert_major(routing_map_TE))


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
