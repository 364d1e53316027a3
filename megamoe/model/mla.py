"""Multi-latent attention (DeepSeek-V2/V3; Megatron's MLASelfAttention).

Queries, keys and values come from low-rank latents instead of one QKV GEMM:

    q      = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))   (--q-lora-rank)
           | linear_q_proj(x)                                        (no --q-lora-rank)
    kv_lat, k_pe = split(linear_kv_down_proj(x), [kv_lora_rank, qk_pos_emb_head_dim])
    k_nope, v = split(linear_kv_up_proj(kv_layernorm(kv_lat)) per head, [qk_head_dim, v_head_dim])
    q_nope, q_pe = split(q per head, [qk_head_dim, qk_pos_emb_head_dim])
    q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe) (one for all heads)]
    out = linear_proj(softmax(q k^T * softmax_scale) v)

The latent norms exist with --qk-layernorm only (Megatron's MLA spec; DeepSeek-V3 has
both). RoPE on the position part uses MLA's interleaved convention (rope.py
`apply_rotary_interleaved`): YaRN by default (--rope-type), cos and sin times YaRN's
concentration mscale(factor, --mscale) / mscale(factor, --mscale-all-dim), and the softmax
scale is mscale(factor, --mscale-all-dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim), as
Megatron's MultiLatentAttention and transformers' DeepseekV3Attention.

Tensor parallelism (Megatron's): heads are split over TP. The up projections
(linear_q_proj / linear_q_up_proj, linear_kv_up_proj: rows head-major, so a contiguous row
chunk is whole heads) are column-parallel and linear_proj is row-parallel; the down
projections and latent norms are replicated. Without SP each rank runs them on the whole
sequence and the up projections' TP entry (and k_pe's `copy_to_tp`) sum their input
gradients over TP, so their weight gradients are whole on every rank. With SP they run on
this rank's sequence shard (the up projections gather the latents, k_pe is gathered), so
their gradients are partial: the parallelize step marks them `sequence_parallel` and the
gradient reduction sums them over TP.

Names and the Hugging Face DeepSeek-V3 (`DeepseekV3Attention`) names, tensor for tensor
(hf_mapping.py `mla_to_hf` / `mla_from_hf` convert a layer's keys):

    linear_q_proj.weight          q_proj.weight              (no q compression)
    linear_q_down_proj.weight     q_a_proj.weight
    q_layernorm.weight            q_a_layernorm.weight
    linear_q_up_proj.weight       q_b_proj.weight
    linear_kv_down_proj.weight    kv_a_proj_with_mqa.weight
    kv_layernorm.weight           kv_a_layernorm.weight
    linear_kv_up_proj.weight      kv_b_proj.weight
    linear_proj.weight            o_proj.weight

The layouts are equal (both head-major, position channels last, rope_interleave=True's
pair order), so the conversion renames only.

Context parallelism (Megatron's): with `cp_group` set (parallelize.py) this rank's tokens
are chunks r and 2CP-1-r of the sequence; RoPE takes their positions from the batch
(training/cp_batch.py makes them explicit), and core attention is
parallel/context_parallel.py's `cp_attention` with MLA's softmax scale and document ids,
its ring carrying K (qk + pe) and V (v_head_dim) at their own widths.

--transformer-impl transformer_engine (model/te/mla.py, Megatron's MLA TE spec): TE's
modules run the projections and core attention with these parameters; with
--qk-layernorm the latent norms run fused inside the up projections (`fused_latent_norms`:
this module then skips its own).

--recompute-modules mla_up_proj (Megatron's meaning): the up projections and RoPE keep
only their inputs; their outputs q, k, v are not kept by core attention and are
recomputed in backward (parallel/checkpointing.py `discard_saved`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.attention import DocumentMask
from megamoe.model.attention_backend import is_flash_only, kernel_context
from megamoe.model.norms import build_norm
from megamoe.model.rope import (
    apply_rotary_interleaved,
    rotary_cos_sin,
    yarn_concentration,
    yarn_cos_sin,
    yarn_get_mscale,
)
from megamoe.parallel.checkpointing import maybe_checkpoint, maybe_discard
from megamoe.parallel.comm import copy_to_tp, gather_from_sequence
from megamoe.parallel.context_parallel import cp_attention
from megamoe.parallel.linear import Linear
from megamoe.parallel.tensor_parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
)

Rotary = tuple[torch.Tensor, torch.Tensor]


def mla_softmax_scale(config: ModelConfig) -> float:
    """mscale(factor, --mscale-all-dim)^2 / sqrt(q head dim) (Megatron, for rope and yarn)."""
    m = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return m * m / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


def mla_cos_sin(config: ModelConfig, seq_length: int,
                position_ids_BS: Optional[torch.Tensor] = None,
                device: Optional[torch.device] = None) -> Rotary:
    """MLA's (cos, sin) [S, B|1, 1, rotary dim] in fp32 for positions 0..S-1 (or ids)."""
    dim = config.mla_rotary_dim
    if config.mla_rope_type == "rope":
        return rotary_cos_sin(seq_length, dim, config.rotary_base,
                              position_ids_BS=position_ids_BS, device=device)
    concentration = yarn_concentration(config.rotary_scaling_factor, config.mscale,
                                       config.mscale_all_dim)
    return yarn_cos_sin(seq_length, dim, config.rotary_base, config.rotary_scaling_factor,
                        config.original_max_position_embeddings, config.beta_fast,
                        config.beta_slow, concentration, position_ids_BS=position_ids_BS,
                        device=device)


class MLASelfAttention(nn.Module):
    """[S, B, H] -> [S, B, H] ([S/TP, B, H] shards with SP); see the module docstring."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tp: TensorParallel = SINGLE
        self.attention_dropout = config.attention_dropout
        self.use_flash_attn = config.use_flash_attn
        self.attention_backend = config.attention_backend
        self.recompute_core_attn = False  # --recompute-modules core_attn (parallelize sets)
        self.recompute_up_proj = False  # --recompute-modules mla_up_proj (parallelize sets)
        # Context parallelism (parallelize sets both): this rank holds chunks r and
        # 2CP-1-r of the sequence; core attention runs parallel/context_parallel.py's op.
        self.cp_group = None
        self.cp_comm_type = "p2p"
        # Transformer Engine (model/te/mla.py sets these): the latent norms run fused inside
        # the up projections (LayerNormLinear), and core attention is TE's
        # DotProductAttention ((q, k, v) -> o in `core_attention`'s layouts)
        self.fused_latent_norms = False
        self.te_core_attention = None
        heads, h, std = config.num_attention_heads, config.hidden_size, config.init_method_std
        self.qk_head_dim, self.pe_dim = config.qk_head_dim, config.qk_pos_emb_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_head_dim = self.qk_head_dim + self.pe_dim
        self.softmax_scale = mla_softmax_scale(config)
        rank = config.q_lora_rank
        self.linear_q_proj = self.linear_q_down_proj = self.linear_q_up_proj = None
        self.q_layernorm = None
        if rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, heads * self.q_head_dim, bias=False,
                                                      init_std=std)
        else:
            self.linear_q_down_proj = Linear(h, rank, bias=False, init_std=std)
            self.linear_q_up_proj = ColumnParallelLinear(rank, heads * self.q_head_dim,
                                                         bias=False, init_std=std)
            if config.qk_layernorm:
                self.q_layernorm = build_norm(config, rank)
        self.linear_kv_down_proj = Linear(h, self.kv_lora_rank + self.pe_dim, bias=False,
                                          init_std=std)
        self.linear_kv_up_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.qk_head_dim + self.v_head_dim), bias=False,
            init_std=std)
        self.kv_layernorm = (build_norm(config, self.kv_lora_rank) if config.qk_layernorm
                             else None)
        self.linear_proj = RowParallelLinear(
            heads * self.v_head_dim, h, bias=config.add_bias_linear,
            init_std=std / math.sqrt(2.0 * config.num_layers))

    def replicated_modules(self) -> list[nn.Module]:
        """The TP-replicated down projections and latent norms (sequence shards under SP)."""
        return [m for m in (self.linear_q_down_proj, self.q_layernorm,
                            self.linear_kv_down_proj, self.kv_layernorm) if m is not None]

    def forward(self, x_SBH: torch.Tensor, rotary: Optional[Rotary] = None,
                docs: Optional[DocumentMask] = None) -> torch.Tensor:
        """`rotary`: MLA's (cos, sin) for the full sequence, or under CP for this rank's
        tokens' positions (`mla_cos_sin`; computed here for positions 0..S-1 when not
        given); `docs`: attention stays inside documents."""
        q_in, kv_lat, k_pe_SBP = self._down_proj(x_SBH)
        if rotary is None:
            rotary = mla_cos_sin(self.config, k_pe_SBP.shape[0], device=x_SBH.device)
        qkv = self._up_proj_and_rope(q_in, kv_lat, k_pe_SBP, rotary)
        if self.cp_group is not None:  # document ids: the op masks each block itself
            core, mask = self.cp_core_attention, docs.ids_BS if docs is not None else None
        else:
            core, mask = self.core_attention, docs.mask() if docs is not None else None
        with maybe_discard(self.recompute_up_proj, qkv,
                           lambda: self._up_proj_and_rope(q_in, kv_lat, k_pe_SBP, rotary)):
            o_BNSV = maybe_checkpoint(self.recompute_core_attn, core, *qkv, mask)
        b, n, s, _ = o_BNSV.shape
        return self.linear_proj(o_BNSV.permute(2, 0, 1, 3).reshape(s, b, n * self.v_head_dim))

    def _down_proj(self, x_SBH: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query up-projection input, kv latent, k_pe [S, B, P] full sequence): the
        latents normed here, or by the up projections when TE fuses the norms."""
        q_in = x_SBH
        if self.linear_q_down_proj is not None:
            q_in = self.linear_q_down_proj(x_SBH)
            if self.q_layernorm is not None and not self.fused_latent_norms:
                q_in = self.q_layernorm(q_in)
        kv_lat, k_pe = self.linear_kv_down_proj(x_SBH).split(
            [self.kv_lora_rank, self.pe_dim], dim=-1)
        if self.kv_layernorm is not None and not self.fused_latent_norms:
            kv_lat = self.kv_layernorm(kv_lat)
        if self.tp.sp:  # every rank's heads use the whole sequence's k_pe
            k_pe = gather_from_sequence(k_pe, self.tp.group)
        else:
            k_pe = copy_to_tp(k_pe, self.tp.group)
        return q_in, kv_lat, k_pe

    def _up_proj_and_rope(self, q_in: torch.Tensor, kv_lat: torch.Tensor,
                          k_pe_SBP: torch.Tensor, rotary: Rotary
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's heads: q, k [B, N, S, qk + pe], v [B, N, S, v_head_dim], contiguous."""
        q_proj = self.linear_q_proj if self.linear_q_proj is not None else self.linear_q_up_proj
        q = q_proj(q_in)
        s, b, _ = q.shape
        q_nope, q_pe = q.view(s, b, -1, self.q_head_dim).split(
            [self.qk_head_dim, self.pe_dim], dim=-1)
        n = q_nope.shape[2]
        kv = self.linear_kv_up_proj(kv_lat).view(s, b, n, self.qk_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        q_pe = apply_rotary_interleaved(q_pe, *rotary)
        k_pe = apply_rotary_interleaved(k_pe_SBP.unsqueeze(2), *rotary)  # one head
        q_SBND = torch.cat((q_nope, q_pe), dim=-1)
        k_SBND = torch.cat((k_nope, k_pe.expand(-1, -1, n, -1)), dim=-1)
        return tuple(t.permute(1, 2, 0, 3).contiguous() for t in (q_SBND, k_SBND, v))

    def core_attention(self, q_BNSD: torch.Tensor, k_BNSD: torch.Tensor,
                       v_BNSV: torch.Tensor,
                       mask_B1SS: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal (or document-causal) SDPA with MLA's softmax scale. The flash kernel
        needs equal q/k and v head dims: v is zero-padded for it and the output trimmed.
        TE's DotProductAttention takes the two head dims as they are (kv_channels=(k, v))."""
        has_mask = mask_B1SS is not None
        if self.te_core_attention is not None:
            if has_mask:  # (the run's checks refuse --reset-attention-mask)
                raise ValueError("not supported yet: --reset-attention-mask with "
                                 "--transformer-impl transformer_engine")
            with self.tp.dropout_rng(split=True):
                return self.te_core_attention(q_BNSD, k_BNSD, v_BNSV)
        flash = is_flash_only(self.attention_backend, self.use_flash_attn, has_mask)
        v_dim = v_BNSV.shape[-1]
        if flash and v_dim != q_BNSD.shape[-1]:
            v_BNSV = F.pad(v_BNSV, (0, q_BNSD.shape[-1] - v_dim))
        kernel = kernel_context(self.attention_backend, self.use_flash_attn, has_mask)
        with self.tp.dropout_rng(split=True), kernel:  # this rank's heads: its own stream
            o_BNSV = F.scaled_dot_product_attention(
                q_BNSD, k_BNSD, v_BNSV, attn_mask=mask_B1SS, is_causal=mask_B1SS is None,
                dropout_p=self.attention_dropout if self.training else 0.0,
                scale=self.softmax_scale)
        return o_BNSV[..., :v_dim]

    def cp_core_attention(self, q_BNSD: torch.Tensor, k_BNSD: torch.Tensor,
                          v_BNSV: torch.Tensor,
                          doc_ids_BS: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Core attention of this cp rank's queries against the whole sequence with MLA's
        softmax scale (the ring carries K and V at their own head dims, no padding);
        dropout from this rank's heads' stream, as `core_attention`; --attention-backend
        restricts the blocks' kernels as it restricts SDPA's (parallel/cp_blocks.py)."""
        kernel = kernel_context(self.attention_backend, self.use_flash_attn,
                                doc_ids_BS is not None)
        with self.tp.dropout_rng(split=True), kernel:
            return cp_attention(q_BNSD, k_BNSD, v_BNSV, self.cp_group, self.cp_comm_type,
                                doc_ids_BS, scale=self.softmax_scale,
                                dropout_p=self.attention_dropout if self.training else 0.0)
