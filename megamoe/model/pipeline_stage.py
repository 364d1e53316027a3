"""GPT split into pipeline stages (and virtual stages, for the interleaved schedule).

Layout-independent init: the full `GPTModel` is built once with the seed (the same RNG
draws as one process), then each rank keeps only its layers, so a stage's weights are
exactly the single-process weights of those layers. The first virtual stage owns the
embedding; the last owns the final norm, output layer and loss. With tied embeddings the
last stage keeps a copy of the word embedding; both copies are marked `shared_embedding`
(their gradients are summed over the embedding group, so they stay equal) and the copy is
marked `shared_copy` (the grad norm counts it once).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.gpt_model import GPTModel, lm_head, rotary_for
from megamoe.parallel.tensor_parallel import TensorParallel


def pipeline_layer_ranges(num_layers: int, pp: int, layers_per_virtual_stage: Optional[int] = None,
                          first: Optional[int] = None, last: Optional[int] = None
                          ) -> list[list[tuple[int, int]]]:
    """[rank][chunk] -> (first layer, end layer). Virtual stage v = chunk * pp + rank holds
    consecutive layers; uneven first/last stages take `first` / `last` layers and the middle
    stages share the rest evenly. Raises ValueError naming the flags on a bad split."""
    if layers_per_virtual_stage is not None:
        if first is not None or last is not None:
            raise ValueError("--num-layers-per-virtual-pipeline-stage cannot be combined with "
                             "--decoder-first/last-pipeline-num-layers")
        if layers_per_virtual_stage < 1 or num_layers % (pp * layers_per_virtual_stage):
            raise ValueError(
                f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-"
                f"size ({pp}) x --num-layers-per-virtual-pipeline-stage "
                f"({layers_per_virtual_stage})")
        chunks = num_layers // (pp * layers_per_virtual_stage)
        n = layers_per_virtual_stage
        return [[((c * pp + r) * n, (c * pp + r + 1) * n) for c in range(chunks)]
                for r in range(pp)]
    if pp == 1 and (first is not None or last is not None):
        raise ValueError("--decoder-first/last-pipeline-num-layers need "
                         "--pipeline-model-parallel-size > 1")
    counts: list[Optional[int]] = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if any(c is not None and c < 1 for c in counts) or rest < 0 or (
            free and (rest % len(free) or rest // len(free) < 1)) or (not free and rest):
        raise ValueError(
            f"--num-layers ({num_layers}) cannot be split over --pipeline-model-parallel-size "
            f"({pp}) stages (first stage {first}, last stage {last}): every stage needs at "
            "least one layer and the other stages an equal share")
    for i in free:
        counts[i] = rest // len(free)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return [[(bounds[r], bounds[r + 1])] for r in range(pp)]


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
        tied = full.output_layer is None
        if tied and tied_across_stages:
            word = full.embedding.word_embeddings.weight
            if pre_process:
                word.shared_embedding = True
            if post_process:
                copy = nn.Parameter(word.detach().clone())
                copy.tensor_model_parallel = getattr(word, "tensor_model_parallel", False)
                copy.shared_embedding = copy.shared_copy = True
                self.shared_output_weight = copy

    def output_weight(self) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer.weight
        if self.shared_output_weight is not None:
            return self.shared_output_weight
        return self.embedding.word_embeddings.weight

    def forward(self, hidden: Optional[torch.Tensor], tokens_BS: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden [S(/TP), B, H] from the previous stage (None on the first) -> hidden for
        the next stage, or on the last stage the per-token loss [B, S] (logits without
        labels)."""
        h_SBH = self.embedding(tokens_BS, position_ids) if self.pre_process else hidden
        rotary = rotary_for(self.config, tokens_BS, position_ids)
        for layer in self.layers:
            h_SBH = layer(h_SBH, rotary)
        if not self.post_process:
            return h_SBH
        return lm_head(self.final_layernorm(h_SBH), self.output_weight(), labels, self.config,
                       self.tp)


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


def build_pipeline_model(config: ModelConfig, tp: Optional[TensorParallel], pp_rank: int,
                         pp_size: int, pp_group, pp_ranks: list[int],
                         layers_per_virtual_stage: Optional[int] = None,
                         first: Optional[int] = None, last: Optional[int] = None
                         ) -> PipelineModel:
    """Build the full model with the current RNG state, keep this rank's chunks."""
    ranges = pipeline_layer_ranges(config.num_layers, pp_size, layers_per_virtual_stage,
                                   first, last)
    full = GPTModel(config, tp)
    mine = ranges[pp_rank]
    num_chunks = len(mine)
    chunks = []
    for c, (start, end) in enumerate(mine):
        v = c * pp_size + pp_rank
        chunks.append(GPTStage(full, start, end, pre_process=v == 0,
                               post_process=v == num_chunks * pp_size - 1,
                               tied_across_stages=pp_size > 1))
    return PipelineModel(chunks, pp_rank, pp_size, pp_group, pp_ranks)
