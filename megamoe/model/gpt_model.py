"""GPT decoder: embedding -> transformer block -> output layer (-> per-token loss).

Internally Megatron's [S, B, H] layout. The word embedding has `padded_vocab_size` rows
(GEMM-friendly, layout-independent), but only the first `vocab_size` rows ever produce
logits: the output GEMM uses the real-vocabulary slice of the weight, so padded logits
never exist, never enter the softmax, and padding cannot change the loss.

Tensor parallelism (`tp`): the vocabulary (padded, layout-independent) is split into TP
equal row ranges; each rank's output GEMM uses only the real-vocabulary rows of its range
(possibly none), and the loss is the vocab-parallel cross entropy, so full-vocabulary
logits are never gathered in training. With sequence parallelism the decoder runs on
[S/TP, B, H] shards; the loss is over the full sequence on every TP rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.attention import DocumentMask
from megamoe.model.mla import mla_cos_sin
from megamoe.model.mtp import MultiTokenPrediction, with_mtp_loss
from megamoe.model.rope import rotary_cos_sin, rotary_dim
from megamoe.model.transformer_block import TransformerBlock
from megamoe.parallel.comm import (
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)
from megamoe.parallel.linear import Embedding
from megamoe.parallel.tensor_parallel import (
    SINGLE,
    TensorParallel,
    VocabParallelEmbedding,
    gather_vocab_logits,
    vocab_parallel_cross_entropy,
)


class GPTEmbedding(nn.Module):
    """Word (+ learned absolute position) embedding, dropout; [B, S] -> [S, B, H]
    ([S/TP, B, H] with sequence parallelism)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.tp: TensorParallel = SINGLE
        self.config = config
        std = config.init_method_std
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size,
                                                      config.hidden_size, init_std=std)
        self.position_embeddings = None  # under SP: a partial gradient (parallelize marks it)
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = Embedding(config.max_position_embeddings,
                                                 config.hidden_size, init_std=std)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens_BS: torch.Tensor,
                position_ids_BS: Optional[torch.Tensor] = None,
                word_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`word_weight`: look up this table (this rank's rows) instead of the module's
        own (the last pipeline stage's copy, for MTP: without_table)."""
        x_BSH = self.word_embeddings(tokens_BS, word_weight)
        if self.tp.size == 1:
            if self.position_embeddings is not None:
                if position_ids_BS is None:
                    position_ids_BS = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
                x_BSH = x_BSH + self.position_embeddings(position_ids_BS)  # [B|1, S, H] bcast
            return self.dropout(x_BSH.transpose(0, 1).contiguous())  # [S, B, H]
        x_SBH = x_BSH.transpose(0, 1).contiguous()  # partial sums over the vocab shards
        if self.tp.sp:
            x_SBH = reduce_scatter_to_sequence(x_SBH, self.tp.group)  # [S/TP, B, H]
        else:
            x_SBH = reduce_from_tp(x_SBH, self.tp.group)
        if self.position_embeddings is not None:
            if position_ids_BS is None:
                position_ids_BS = torch.arange(tokens_BS.shape[1],
                                               device=tokens_BS.device)[None]
            if self.tp.sp:
                position_ids_BS = position_ids_BS.chunk(self.tp.size, dim=1)[self.tp.rank]
            x_SBH = x_SBH + self.position_embeddings(position_ids_BS).transpose(0, 1)
        with self.tp.dropout_rng(split=self.tp.sp):
            return self.dropout(x_SBH)

    def without_table(self) -> GPTEmbedding:
        """This embedding's lookup with no word table of its own (its word_embeddings'
        weight is None: forward takes `word_weight`), for a last pipeline stage that has
        MTP and only a copy of the table. No position table (refused with PP and MTP)."""
        with torch.device("meta"):  # (no draws from the real generator, no memory)
            shell = GPTEmbedding(replace(self.config, position_embedding_type="none"))
        shell.word_embeddings.shard(self.word_embeddings.tp)
        shell.word_embeddings.weight = None
        shell.tp = self.tp
        return shell


class GPTModel(nn.Module):
    """The single-process model; megamoe.parallelize turns it into this rank's part."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tp: TensorParallel = SINGLE
        self.embedding = GPTEmbedding(config)
        self.decoder = TransformerBlock(config)
        self.output_layer = None
        # --fp8-output-proj: the output GEMM (x, W, b) -> y the FP8 policy sets (model/fp8/)
        self.output_fp8: Optional[Callable] = None
        if config.untie_embeddings_and_output_weights:
            # Same draws as Linear(H, padded_vocab); rows split like the word embedding.
            self.output_layer = VocabParallelEmbedding(
                config.padded_vocab_size, config.hidden_size,
                init_std=config.init_method_std)
        # Built last: the other weights draw what they draw without MTP.
        self.mtp = MultiTokenPrediction(config) if config.mtp_num_layers else None

    def output_weight(self) -> torch.Tensor:
        """[padded_vocab (/ TP), H] matrix of the output layer (the word embedding when tied)."""
        layer = self.output_layer if self.output_layer is not None else \
            self.embedding.word_embeddings
        return layer.weight

    def forward(self, tokens_BS: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None,
                mtp_token_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab_size], or with `labels` [B, S] the per-token
        cross-entropy [B, S] in fp32 (no reduction: the schedule masks and averages);
        `document_ids` [B, S] (--reset-attention-mask) keeps attention inside documents.
        With MTP, training: the returned loss carries the MTP loss into the gradient
        (`loss_mask` [B, S] masks it, as the schedule masks the LM loss;
        `mtp_token_scales` [D] with --calculate-per-token-loss; model/mtp.py)."""
        rotary = rotary_for(self.config, tokens_BS, position_ids)
        docs = documents_for(document_ids)
        h_SBH = self.decoder(self.embedding(tokens_BS, position_ids), rotary, docs)
        w_VH = self.output_weight()
        gemm = self.output_fp8
        loss = lm_head(h_SBH, w_VH, labels, self.config, self.tp, gemm)
        return with_mtp_loss(self.mtp, loss, h_SBH, tokens_BS, position_ids, labels,
                             loss_mask, self.embedding,
                             loss_head(w_VH, self.config, self.tp, gemm),
                             rotary, docs, mtp_token_scales)


OutputGemm = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def loss_head(w_VH: torch.Tensor, config: ModelConfig, tp: TensorParallel,
              gemm: Optional[OutputGemm] = None
              ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(h, labels) -> per-token loss through the output layer `w_VH` (the MTP depths':
    the same layer and GEMM as the main head, as Megatron's shared output_layer)."""
    return lambda h_SBH, labels: lm_head(h_SBH, w_VH, labels, config, tp, gemm)


def documents_for(document_ids_BS: Optional[torch.Tensor]) -> Optional[DocumentMask]:
    """The mask attention shares across layers, or None (plain causal attention)."""
    return None if document_ids_BS is None else DocumentMask(document_ids_BS)


def rotary_for(config: ModelConfig, tokens_BS: torch.Tensor,
               position_ids: Optional[torch.Tensor]
               ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """RoPE (cos, sin) for the full sequence, or None without rotary embeddings. With
    multi-latent attention: MLA's own (YaRN) rotary embedding, whatever
    --position-embedding-type says (as Megatron, where that flag only decides the learned
    absolute embedding then)."""
    if config.multi_latent_attention:
        return mla_cos_sin(config, tokens_BS.shape[1], position_ids, tokens_BS.device)
    if config.position_embedding_type != "rope":
        return None
    rot_dim = rotary_dim(config.kv_channels, config.rotary_percent)
    return rotary_cos_sin(tokens_BS.shape[1], rot_dim, config.rotary_base,
                          position_ids_BS=position_ids, device=tokens_BS.device,
                          rope_scaling_factor=config.rope_scaling_factor
                          if config.use_rope_scaling else None)


def lm_head(h_SBH: torch.Tensor, w_VH: torch.Tensor, labels: Optional[torch.Tensor],
            config: ModelConfig, tp: TensorParallel,
            gemm: Optional[OutputGemm] = None) -> torch.Tensor:
    """Final hidden states (after the final norm) -> logits [B, S, vocab] or, with labels,
    per-token loss [B, S] (fp32). `w_VH` is this rank's [padded_vocab / TP, H] rows; only
    its real-vocabulary rows are multiplied, so padded logits never exist. `gemm`: the
    output GEMM in FP8 (--fp8-output-proj), else F.linear."""
    gemm = gemm or F.linear
    if tp.size == 1:
        h_BSH = h_SBH.transpose(0, 1)
        logits_BSV = gemm(h_BSH, w_VH[: config.vocab_size], None)
        if labels is None:
            return logits_BSV
        b, s, v = logits_BSV.shape
        loss = F.cross_entropy(logits_BSV.float().reshape(b * s, v), labels.reshape(b * s),
                               reduction="none")
        return loss.view(b, s)
    per_rank = config.padded_vocab_size // tp.size
    vocab_start = tp.rank * per_rank
    num_real_rows = max(0, min(per_rank, config.vocab_size - vocab_start))
    if tp.sp:
        h_SBH = gather_from_sequence(h_SBH, tp.group)  # [S, B, H]
    else:
        h_SBH = copy_to_tp(h_SBH, tp.group)
    logits_BSV = gemm(h_SBH.transpose(0, 1), w_VH[:num_real_rows], None)  # [B, S, V_local]
    if labels is None:
        return gather_vocab_logits(logits_BSV, config.vocab_size, per_rank, tp.group)
    return vocab_parallel_cross_entropy(logits_BSV, labels, vocab_start, tp.group)
