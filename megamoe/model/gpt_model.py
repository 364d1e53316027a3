"""GPT decoder: embedding -> transformer block -> output layer (-> per-token loss).

Internally Megatron's [S, B, H] layout. The word embedding has `padded_vocab_size` rows
(GEMM-friendly, layout-independent), but only the first `vocab_size` rows ever produce
logits: the output GEMM uses the real-vocabulary slice of the weight, so padded logits
never exist, never enter the softmax, and padding cannot change the loss.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.linear import Embedding, Linear
from megamoe.model.rope import rotary_cos_sin, rotary_dim
from megamoe.model.transformer_block import TransformerBlock


class GPTEmbedding(nn.Module):
    """Word (+ learned absolute position) embedding, dropout; [B, S] -> [S, B, H]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        std = config.init_method_std
        self.word_embeddings = Embedding(config.padded_vocab_size, config.hidden_size,
                                         init_std=std)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = Embedding(config.max_position_embeddings,
                                                 config.hidden_size, init_std=std)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens_BS: torch.Tensor,
                position_ids_BS: Optional[torch.Tensor] = None) -> torch.Tensor:
        x_BSH = self.word_embeddings(tokens_BS)
        if self.position_embeddings is not None:
            if position_ids_BS is None:
                position_ids_BS = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
            x_BSH = x_BSH + self.position_embeddings(position_ids_BS)  # [B|1, S, H] bcast
        return self.dropout(x_BSH.transpose(0, 1).contiguous())  # [S, B, H]


class GPTModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"unknown position_embedding_type "
                             f"{config.position_embedding_type!r}")
        self.config = config
        self.embedding = GPTEmbedding(config)
        self.rot_dim = None
        if config.position_embedding_type == "rope":
            self.rot_dim = rotary_dim(config.kv_channels, config.rotary_percent)
        self.decoder = TransformerBlock(config)
        self.output_layer = None
        if config.untie_embeddings_and_output_weights:
            self.output_layer = Linear(config.hidden_size, config.padded_vocab_size,
                                       bias=False, init_std=config.init_method_std)

    def output_weight(self) -> torch.Tensor:
        """[padded_vocab, H] matrix of the output layer (the word embedding when tied)."""
        layer = self.output_layer if self.output_layer is not None else \
            self.embedding.word_embeddings
        return layer.weight

    def forward(self, tokens_BS: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab_size], or with `labels` [B, S] the per-token
        cross-entropy [B, S] in fp32 (no reduction: the schedule masks and averages)."""
        rotary = None
        if self.rot_dim is not None:
            rotary = rotary_cos_sin(tokens_BS.shape[1], self.rot_dim, self.config.rotary_base,
                                    position_ids_BS=position_ids, device=tokens_BS.device)
        h_SBH = self.decoder(self.embedding(tokens_BS, position_ids), rotary)
        h_BSH = h_SBH.transpose(0, 1)
        w_VH = self.output_weight()[: self.config.vocab_size]  # real vocabulary rows only
        logits_BSV = F.linear(h_BSH, w_VH)
        if labels is None:
            return logits_BSV
        b, s, v = logits_BSV.shape
        loss = F.cross_entropy(logits_BSV.float().reshape(b * s, v), labels.reshape(b * s),
                               reduction="none")
        return loss.view(b, s)
