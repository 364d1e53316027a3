"""GPT split into pipeline stages (and virtual stages, for the interleaved schedule).

Layout-independent init: the full `GPTModel` is built once with the seed (the same RNG
draws as one process; on the meta device it costs nothing), then each rank keeps only its
layers, so a stage's weights are exactly the single-process weights of those layers. The
first virtual stage owns the embedding; the last owns the final norm, output layer and
loss. With tied embeddings the last stage keeps a copy of the word embedding; both copies
are marked `shared_embedding` (their gradients are summed over the embedding group, so
they stay equal) and the copy is marked `shared_copy` (the grad norm counts it once).
With MTP (model/mtp.py, on the last stage, as Megatron) the last stage keeps that copy of
the word embedding even when the output layer is untied: the MTP depths look their tokens
up in it, and its gradient joins the first stage's the same way.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.gpt_model import (
    GPTModel,
    documents_for,
    lm_head,
    loss_head,
    rotary_for,
)
from megamoe.model.mtp import with_mtp_loss
from megamoe.model.transformer_block import run_layers
from megamoe.parallel.tensor_parallel import TensorParallel


class GPTStage(nn.Module):
    """Layers [start, end) of the decoder, plus the embedding (first virtual stage) and/or
    the final norm, output layer and loss (last virtual stage)."""

    def __init__(self, full: GPTModel, start: int, end: int, *, pre_process: bool,
                 post_process: bool, tied_across_stages: bool):
        super().__init__()
        self.config: ModelConfig = full.config
        self.tp: TensorParallel = full.tp
        self.pre_process, self.post_process = pre_process, post_process
        self.embedding = full.embedding if pre_process else None
        self.layers = nn.ModuleList(full.decoder.layers[start:end])
        self.final_layernorm = full.decoder.final_layernorm if post_process else None
        self.output_layer = full.output_layer if post_process else None
        self.shared_output_weight = None
        self.output_fp8 = None  # --fp8-output-proj: the output GEMM (as GPTModel's)
        self.recompute_groups: list[list[int]] = []  # full recompute, per model chunk
        self.mtp = full.mtp if post_process else None
        self.mtp_embedding = None  # the MTP lookup of a last stage without the embedding
        tied = full.output_layer is None
        if (tied or full.mtp is not None) and tied_across_stages:
            word = full.embedding.word_embeddings.weight
            if pre_process:
                word.shared_embedding = True
            if post_process:
                copy = nn.Parameter(word.detach().clone())
                self.init_stds = {"shared_output_weight": full.config.init_method_std}
                copy.tensor_model_parallel = getattr(word, "tensor_model_parallel", False)
                copy.shared_embedding = copy.shared_copy = True
                self.shared_output_weight = copy
                if self.mtp is not None:
                    self.mtp_embedding = full.embedding.without_table()

    def output_weight(self) -> torch.Tensor:
        """The output layer's [padded_vocab (/ TP), H] table (the word embedding when
        tied: this stage's copy of it on the last of several stages)."""
        if self.output_layer is not None:
            return self.output_layer.weight
        if self.shared_output_weight is not None:
            return self.shared_output_weight
        return self.embedding.word_embeddings.weight

    def forward(self, hidden: Optional[torch.Tensor], tokens_BS: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None,
                mtp_token_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden [S(/TP), B, H] from the previous stage (None on the first) -> hidden for
        the next stage, or on the last stage the per-token loss [B, S] (logits without
        labels); `document_ids`, `loss_mask` and `mtp_token_scales` (MTP) as
        GPTModel.forward."""
        h_SBH = self.embedding(tokens_BS, position_ids) if self.pre_process else hidden
        rotary = rotary_for(self.config, tokens_BS, position_ids)
        docs = documents_for(document_ids)
        h_SBH = run_layers(self.layers, h_SBH, rotary, self.recompute_groups, docs)
        if not self.post_process:
            return h_SBH
        h_SBH = self.final_layernorm(h_SBH)
        w_VH = self.output_weight()
        gemm = self.output_fp8
        loss = lm_head(h_SBH, w_VH, labels, self.config, self.tp, gemm)
        return with_mtp_loss(self.mtp, loss, h_SBH, tokens_BS, position_ids, labels,
                             loss_mask, self._mtp_embed(),
                             loss_head(w_VH, self.config, self.tp, gemm),
                             rotary, docs, mtp_token_scales)

    def _mtp_embed(self):
        """The embedding MTP looks tokens up with: this stage's own, or (last of several
        stages) the stage's copy of the word table through a table-less lookup."""
        if self.mtp_embedding is None:
            return self.embedding
        copy = self.shared_output_weight
        return lambda tokens_BS, position_ids: self.mtp_embedding(tokens_BS, position_ids,
                                                                  word_weight=copy)


class PipelineModel(nn.Module):
    """This rank's virtual stages (model chunks) and its place in the pipeline."""

    def __init__(self, chunks: list[GPTStage], pp_rank: int, pp_size: int,
                 pp_group, pp_ranks: list[int]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.pp_group = pp_group
        self.pp_ranks = pp_ranks  # global ranks of this pipeline group, by stage

    @property
    def config(self) -> ModelConfig:
        return self.chunks[0].config


def split_pipeline(full: GPTModel, ranges: list[list[tuple[int, int]]], pp_rank: int,
                   pp_group, pp_ranks: list[int]) -> PipelineModel:
    """Keep rank `pp_rank`'s chunks of the (built, possibly tensor-parallel) model; `ranges`
    is the layout's [rank][chunk] -> (first layer, end layer) (ParallelConfig.layer_ranges)."""
    pp_size = len(ranges)
    mine = ranges[pp_rank]
    num_chunks = len(mine)
    chunks = []
    for c, (start, end) in enumerate(mine):
        v = c * pp_size + pp_rank
        chunks.append(GPTStage(full, start, end, pre_process=v == 0,
                               post_process=v == num_chunks * pp_size - 1,
                               tied_across_stages=pp_size > 1))
    return PipelineModel(chunks, pp_rank, pp_size, pp_group, pp_ranks)
