"""Causal self-attention with grouped-query attention (GQA) and optional RoPE.

QKV is one GEMM. `linear_qkv.weight` is [(Nq + 2 * Nkv) * D, H] with rows in three
contiguous blocks: q (Nq * D rows), then k (Nkv * D), then v (Nkv * D); inside each block
head-major (head i = rows i*D:(i+1)*D). So HF q_proj/k_proj/v_proj map to it by a plain
concatenation, and `split_qkv_weight` undoes it. (Megatron interleaves per query group
instead.) Tensor parallelism splits each of the three blocks into TP contiguous chunks, so
rank r holds query heads r*Nq/TP.. and exactly the key/value groups those heads use (a
GQA group never straddles ranks).

Document masking (--reset-attention-mask): a `DocumentMask` carries each token's document
id; attention is causal *and* within one document. The mask SDPA gets is boolean
[B, 1, S, S], built once per forward and shared by every layer and head (1 byte per
query/key pair per sample, broadcast over heads). Why not FlexAttention block masks:
they are only fast compiled (torch.compile on the GPU; eager runs an unfused fallback
that materialises scores for all heads), and the boolean mask runs in SDPA's
memory-efficient kernel on CUDA and in the math kernel on CPU with the same semantics.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.attention_backend import kernel_context
from megamoe.model.norms import ProjectionRMSNorm, build_norm
from megamoe.model.rope import apply_rotary, apply_rotary_pairs
from megamoe.parallel.checkpointing import maybe_checkpoint
from megamoe.parallel.context_parallel import cp_attention
from megamoe.parallel.cp_layout import causal_mask
from megamoe.parallel.tensor_parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
)


class DocumentMask:
    """Per-token document ids [B, S] of packed sequences; `mask()` is the boolean
    document-causal mask [B, 1, S, S] (True: may attend), built on first use and kept, so
    all layers of one forward share one mask."""

    def __init__(self, ids_BS: torch.Tensor):
        self.ids_BS = ids_BS
        self._mask_B1SS: Optional[torch.Tensor] = None

    def mask(self) -> torch.Tensor:
        if self._mask_B1SS is None:
            pos = torch.arange(self.ids_BS.shape[1], device=self.ids_BS.device)
            self._mask_B1SS = causal_mask(pos, pos, self.ids_BS, self.ids_BS)
        return self._mask_B1SS


class SelfAttention(nn.Module):
    """Under tensor parallelism (set by the parallelize step) this rank runs the heads of
    its q/k/v rows: the local head counts follow from linear_qkv's local blocks."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        heads, groups = config.num_attention_heads, config.num_query_groups
        self.head_dim = config.kv_channels
        self.tp: TensorParallel = SINGLE
        self.attention_dropout = config.attention_dropout
        self.use_flash_attn = config.use_flash_attn
        self.attention_backend = config.attention_backend
        self.recompute_core_attn = False  # --recompute-modules core_attn (parallelize sets it)
        # Context parallelism (parallelize sets both): this rank holds chunks r and
        # 2CP-1-r of the sequence; core attention runs parallel/context_parallel.py's op.
        self.cp_group = None
        self.cp_comm_type = "p2p"
        # Transformer Engine's DotProductAttention in place of SDPA (model/te/attention.py;
        # --transformer-impl transformer_engine sets it): (q, k, v) -> o, SDPA's layouts
        self.te_core_attention = None
        q_size = heads * self.head_dim
        kv_size = groups * self.head_dim
        std = config.init_method_std
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, q_size + 2 * kv_size,
            bias=config.add_bias_linear or config.add_qkv_bias,
            init_std=std, blocks=(q_size, kv_size, kv_size))
        self.linear_proj = RowParallelLinear(
            q_size, config.hidden_size, bias=config.add_bias_linear,
            init_std=std / math.sqrt(2.0 * config.num_layers))
        # --qk-layernorm: per head, weights shared by the heads (and by the TP ranks, whose
        # gradients each see their own heads: the parallelize step marks them for a sum);
        # with --qk-layernorm-scope projection one norm over all of q (k), sharded over TP.
        self.q_layernorm = self.k_layernorm = None
        self.qk_norm_whole = config.qk_layernorm_scope == "projection"
        self.rotary_interleaved = config.rotary_interleaved  # RoPE pair order
        if config.qk_layernorm and self.qk_norm_whole:
            self.q_layernorm = ProjectionRMSNorm(q_size, eps=config.norm_epsilon)
            self.k_layernorm = ProjectionRMSNorm(kv_size, eps=config.norm_epsilon)
        elif config.qk_layernorm:
            self.q_layernorm = build_norm(config, self.head_dim)
            self.k_layernorm = build_norm(config, self.head_dim)

    def forward(self, x_SBH: torch.Tensor,
                rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                docs: Optional[DocumentMask] = None) -> torch.Tensor:
        """x [S, B, H] -> [S, B, H] (with SP: [S/TP, B, H] shards in and out); `rotary` =
        (cos, sin) from `rope.rotary_cos_sin` for the full sequence; `docs`: attention
        stays inside each document (--reset-attention-mask)."""
        qkv = self.linear_qkv(x_SBH)  # [S, B, local q + 2 kv]: the full sequence
        s, b, _ = qkv.shape
        q, k, v = qkv.split(self.linear_qkv.local_blocks, dim=-1)
        if self.q_layernorm is not None and self.qk_norm_whole:  # before the head split
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q_SBND = q.view(s, b, -1, self.head_dim)
        k_SBGD = k.view(s, b, -1, self.head_dim)
        v_SBGD = v.view(s, b, -1, self.head_dim)
        num_heads = q_SBND.shape[2]
        if self.q_layernorm is not None and not self.qk_norm_whole:
            q_SBND, k_SBGD = self.q_layernorm(q_SBND), self.k_layernorm(k_SBGD)
        if rotary is not None:
            rotate = apply_rotary_pairs if self.rotary_interleaved else apply_rotary
            q_SBND = rotate(q_SBND, *rotary)
            k_SBGD = rotate(k_SBGD, *rotary)
        # SDPA wants [B, heads, S, D].
        q_BNSD, k_BGSD, v_BGSD = (t.permute(1, 2, 0, 3) for t in (q_SBND, k_SBGD, v_SBGD))
        if self.cp_group is not None:
            o_BNSD = maybe_checkpoint(self.recompute_core_attn, self.cp_core_attention,
                                      q_BNSD, k_BGSD, v_BGSD,
                                      docs.ids_BS if docs is not None else None)
        else:
            mask_B1SS = docs.mask() if docs is not None else None
            o_BNSD = maybe_checkpoint(self.recompute_core_attn, self.core_attention,
                                      q_BNSD, k_BGSD, v_BGSD, mask_B1SS)
        o_SBX = o_BNSD.permute(2, 0, 1, 3).reshape(s, b, num_heads * self.head_dim)
        return self.linear_proj(o_SBX)

    def core_attention(self, q_BNSD: torch.Tensor, k_BGSD: torch.Tensor,
                       v_BGSD: torch.Tensor,
                       mask_B1SS: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal SDPA (Megatron's "core attention": scores, softmax, dropout, x V); with
        `mask_B1SS` (document-causal, bool) the mask replaces is_causal. Flash attention
        takes no mask: with documents SDPA picks its memory-efficient kernel instead."""
        if self.te_core_attention is not None:
            if mask_B1SS is not None:  # (the run's checks refuse --reset-attention-mask)
                raise ValueError("not supported yet: --reset-attention-mask with "
                                 "--transformer-impl transformer_engine")
            with self.tp.dropout_rng(split=True):
                return self.te_core_attention(q_BNSD, k_BGSD, v_BGSD)
        kernel = kernel_context(self.attention_backend, self.use_flash_attn,
                                mask_B1SS is not None)
        with self.tp.dropout_rng(split=True), kernel:  # this rank's heads: its own stream
            return F.scaled_dot_product_attention(
                q_BNSD, k_BGSD, v_BGSD, attn_mask=mask_B1SS, is_causal=mask_B1SS is None,
                dropout_p=self.attention_dropout if self.training else 0.0,
                enable_gqa=k_BGSD.shape[1] != q_BNSD.shape[1])

    def cp_core_attention(self, q_BNSD: torch.Tensor, k_BGSD: torch.Tensor,
                          v_BGSD: torch.Tensor,
                          doc_ids_BS: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Core attention of this cp rank's queries against the whole sequence (dropout
        from this rank's heads' stream, as `core_attention`). --attention-backend restricts
        the blocks' kernels as it restricts SDPA's: unfused/local compute the scores
        explicitly, flash and fused allow only their kernels (parallel/cp_blocks.py)."""
        kernel = kernel_context(self.attention_backend, self.use_flash_attn,
                                doc_ids_BS is not None)
        with self.tp.dropout_rng(split=True), kernel:
            return cp_attention(q_BNSD, k_BGSD, v_BGSD, self.cp_group, self.cp_comm_type,
                                doc_ids_BS, dropout_p=self.attention_dropout
                                if self.training else 0.0)


def split_qkv_weight(w: torch.Tensor, config: ModelConfig
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear_qkv.weight` (or bias) -> (q, k, v) in HF q_proj/k_proj/v_proj layout."""
    q_size = config.num_attention_heads * config.kv_channels
    kv_size = config.num_query_groups * config.kv_channels
    q, k, v = w.split((q_size, kv_size, kv_size), dim=0)
    return q, k, v
