"""The load-balanced context-parallel layout (Megatron's), shared by the cp attention ops
(context_parallel.py, cp_a2a.py), MTP's shifted targets and the training side.

The sequence is cut into 2 x CP chunks of c = S / (2 CP) tokens; cp rank r holds chunks r
and 2CP-1-r, in that order, so every rank has the same share of the causal work.
`split_for_cp` makes that split of any full-sequence tensor, `join_from_cp` puts every
rank's parts back in sequence order, `cp_positions` gives the full-sequence positions of a
rank's tokens (RoPE, masks), and `causal_mask` the (document-)causal attention mask
between tokens by their full-sequence positions.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


def chunk_indices(rank: int, cp: int) -> tuple[int, int]:
    """The two of the 2 x CP sequence chunks cp rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def split_for_cp(x_BS: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of a full-sequence tensor: chunks r and 2CP-1-r along `dim`."""
    if cp == 1:
        return x_BS
    if x_BS.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x_BS.shape[dim]} is not divisible by 2 x "
                         f"--context-parallel-size ({2 * cp})")
    chunks = x_BS.chunk(2 * cp, dim=dim)
    a, b = chunk_indices(rank, cp)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def join_from_cp(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of `split_for_cp` over all ranks: `parts[r]` is rank r's part; returns the
    full-sequence tensor (the parts' chunks in sequence order along `dim`)."""
    cp = len(parts)
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        a, b = chunk_indices(rank, cp)
        chunks[a], chunks[b] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def cp_positions(seq_local: int, rank: int, cp: int, device) -> torch.Tensor:
    """int64 [seq_local]: full-sequence positions of this rank's tokens."""
    c = seq_local // 2
    a, b = chunk_indices(rank, cp)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device),
                      torch.arange(b * c, (b + 1) * c, device=device)])


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, q_ids_BS: Optional[torch.Tensor],
                k_ids_BS: Optional[torch.Tensor]) -> torch.Tensor:
    """bool [B|1, 1, Sq, Sk]: causal by full-sequence position, and within one document
    when document ids are given."""
    m = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if q_ids_BS is not None:
        m = m & (q_ids_BS[:, :, None] == k_ids_BS[:, None, :])[:, None]
    return m


class BlockPlan(NamedTuple):
    """Which part of the causal block (queries of cp rank `rank`, keys of rank `src`) is
    visible, as full rows and columns: queries `q_from` onwards (0: all, c: the second
    chunk only), keys before `k_to` (None: all, c: the first chunk only); `causal`: the
    visible part is lower-triangular (the diagonal block), else fully visible."""

    q_from: int
    k_to: Optional[int]
    causal: bool


def block_plan(rank: int, src: int, cp: int, seq_local: int) -> BlockPlan:
    """The visible part of the block of rank `rank`'s queries against rank `src`'s keys in
    the load-balanced layout (chunks r, 2CP-1-r), without a mask: its own block is causal
    (positions rise along the local sequence); an earlier rank's first chunk (src < r) is
    wholly before both query chunks and its second chunk after both; a later rank's
    chunks (src > r) are both after this rank's first chunk and before its second."""
    c = seq_local // 2
    if src == rank:
        return BlockPlan(0, None, True)
    if src < rank:
        return BlockPlan(0, c, False)
    return BlockPlan(c, None, False)
