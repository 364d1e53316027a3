"""Per-rank memory of a parallel layout: weights, gradients, optimizer states, activations.

Shared by `tools/plan_parallel.py` (which ranks layouts) and `pretrain_gpt.py --dry-run`
(which reports the launch's own layout). The static part follows megamoe's actual layout
and is checked byte for byte against measured runs (tests/tools/test_plan_parallel.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megamoe.config import ModelConfig
from megamoe.model.flops import (
    _attention_params,
    _ffn_params,
    _norm_params,
    attention_tp_replicated,
)
from megamoe.planning.activations import layer_values, recompute_config
from megamoe.planning.pipeline_balance import layer_ranks, rank_layer_counts


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    dp: int
    cp: int
    distributed_optimizer: bool
    recompute: str  # none | full | selective[:modules] (activations.recompute_config)
    micro_batch_size: int
    cp_comm_type: str = "p2p"  # --cp-comm-type for every layer (p2p or a2a), with cp > 1
    # Decoder layers of each virtual stage v = chunk x PP + rank when the split is uneven
    # (--decoder-first/last-pipeline-num-layers, --account-for-*-in-pipeline-split,
    # --pipeline-model-parallel-layout); None: PP x VPP equal chunks.
    split: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.split is not None:  # (from JSON: a list)
            object.__setattr__(self, "split", tuple(self.split))


def _stage_of_layer(model: ModelConfig, lay: Layout, i: int) -> int:
    """Pipeline stage holding layer i: virtual stage v's chunk on stage v % PP."""
    return layer_ranks(model.num_layers, lay.pp, lay.vpp, lay.split)[i]


def _layer_parameters(model: ModelConfig, lay: Layout, i: int) -> tuple[float, float]:
    """(dense, routed-expert) parameters of layer i on one rank (i >= num_layers: an MTP
    layer, of the last decoder layer's kind)."""
    h, norm = model.hidden_size, _norm_params(model)
    attn, _ = _attention_params(model)
    whole = (h if model.add_bias_linear else 0) + attention_tp_replicated(model)
    dense, expert = 2 * norm + (attn - whole) / lay.tp + whole, 0.0
    fc2_bias = h if model.add_bias_linear else 0
    if model.is_moe_layer(i):
        m = model.moe
        one_expert, _ = _ffn_params(model, m.ffn_hidden_size)
        dense += m.num_experts * h  # router
        if m.shared_expert_intermediate_size is not None:  # a TP MLP, as Megatron's
            shared, _ = _ffn_params(model, m.shared_expert_intermediate_size)
            dense += (shared - fc2_bias) / lay.tp + fc2_bias
            dense += h if m.shared_expert_gate else 0
        expert += m.num_experts * ((one_expert - fc2_bias) / lay.etp + fc2_bias) / lay.ep
    else:
        mlp, _ = _ffn_params(model, model.ffn_hidden_size)
        dense += (mlp - fc2_bias) / lay.tp + fc2_bias
    return dense, expert


def stage_parameters(model: ModelConfig, lay: Layout, stage: int) -> tuple[float, float]:
    """(dense, routed-expert) parameters one rank of pipeline stage `stage` holds.

    megamoe's layout: attention, dense-MLP and shared-expert matrices and the (padded)
    vocabulary are split over TP; norms, routers, row-parallel biases, the shared-expert
    gate and MLA's down projections and latent norms are replicated over TP; routed
    experts are split over EP and their hidden dimension over ETP (moe/sharding.py; an fc2
    bias stays whole). The MTP modules live on the last stage (eh_proj split over TP,
    three norms, one layer each)."""
    h, norm = model.hidden_size, _norm_params(model)
    dense = expert = 0.0
    layers = [i for i in range(model.num_layers) if _stage_of_layer(model, lay, i) == stage]
    if stage == lay.pp - 1:
        layers += [model.num_layers + k for k in range(model.num_mtp_layers)]
        dense += model.num_mtp_layers * (3 * norm + 2 * h * h / lay.tp)
    for i in layers:
        d, e = _layer_parameters(model, lay, i)
        dense, expert = dense + d, expert + e
    vocab = math.ceil(model.padded_vocab_size / lay.tp) * h
    if stage == 0:
        dense += vocab
        if model.position_embedding_type == "learned_absolute":
            dense += model.max_position_embeddings * h
    if stage == lay.pp - 1:
        dense += norm  # final norm
        # The output layer; with tied embeddings (or MTP) the last stage keeps a copy of
        # the word embedding (only when it is not also the first stage).
        if model.untie_embeddings_and_output_weights:
            dense += vocab
        if lay.pp > 1 and (model.num_mtp_layers or not model.untie_embeddings_and_output_weights):
            dense += vocab
    return dense, expert


@dataclass(frozen=True)
class StateBytes:
    """Bytes per element of the main gradients and of Adam's two moments: 4 each, or 2
    under --use-precision-aware-optimizer with --main-grads-dtype bf16, --exp-avg-dtype /
    --exp-avg-sq-dtype bf16 or fp16 (training/optim/state_precision.py; an fp16 state's
    one scale per tensor is not counted)."""

    main_grad: int = 4
    exp_avg: int = 4
    exp_avg_sq: int = 4


FP32_STATES = StateBytes()


def stage_bytes(model: ModelConfig, lay: Layout, stage: int, param_bytes: int = 2,
                states: StateBytes = FP32_STATES) -> dict[str, float]:
    """Weights, gradients and optimizer states of one rank of pipeline stage `stage`.

    Matches megamoe/training/optim/ (mixed_precision.py, distributed.py): gradients are
    accumulated in full-size fp32 tensors (fp32: the parameters' .grad; bf16: fp32 main
    grads, the bf16 .grad is freed by the accumulation hook; the distributed optimizer:
    one flat fp32 grad buffer per shard group). Without the distributed optimizer the
    states are two fp32 Adam moments, plus fp32 main parameters with bf16. With it, every
    rank keeps, for its 1/DP slice of the dense parameters (1/EDP of the experts), the two
    moments and, for a bf16 model, an fp32 main copy (fp32: the main slice is the
    parameters' own shard, the reduced gradient slice the grad buffer's): 8 bytes per
    element in fp32, 12 in bf16. `states`: the precision-aware optimizer's smaller main
    gradients and moments. Transients of its step and of a checkpoint save:
    optimizer_memory.py."""
    dense, expert = stage_parameters(model, lay, stage)
    params = dense + expert
    weights, grads = param_bytes * params, states.main_grad * params
    per_element = states.exp_avg + states.exp_avg_sq + (0 if param_bytes == 4 else 4)
    if lay.distributed_optimizer:
        edp = max(lay.dp * lay.cp * lay.tp // (lay.etp * lay.ep), 1)
        opt = per_element * (dense / (lay.dp * lay.cp) + expert / edp)
    else:
        opt = per_element * params
    return {"weights": weights, "gradients": grads, "optimizer": opt, "parameters": params}


def model_bytes(model: ModelConfig, lay: Layout, param_bytes: int = 2,
                states: StateBytes = FP32_STATES) -> dict[str, float]:
    """Weights, gradients and optimizer states on the most loaded GPU (the largest stage)."""
    stages = [stage_bytes(model, lay, s, param_bytes, states) for s in range(lay.pp)]
    return max(stages, key=lambda b: b["weights"] + b["gradients"] + b["optimizer"])


def activation_bytes(model: ModelConfig, lay: Layout, seq_length: int, act_bytes: int = 2
                     ) -> float:
    """Saved activations on the most loaded pipeline stage: per layer what activations.py
    counts for the layout's recompute mode, times the micro-batches the stage holds in
    1F1B. Rank r holds PP - r of them (interleaved: PP + (PP - 1 - 2r) / VPP
    stage-equivalents, Megatron's warm-up counts), so with an even split the first stage
    holds the most; the last also holds the MTP layers and the logits, which can make it
    the larger (DeepSeek-V3's MTP); an uneven split weighs each rank by its own layers."""
    pp, vpp = lay.pp, lay.vpp
    mtp = model.num_mtp_layers
    if pp == 1:
        return _stage_activations(model, lay, seq_length, act_bytes, mtp, [1],
                                  [model.num_layers])[0]
    layers = rank_layer_counts(model.num_layers, pp, vpp, lay.split)
    in_flight = [pp + (pp - 1 - 2 * r) / vpp if vpp > 1 else pp - r for r in range(pp)]
    return max(max(_stage_activations(model, lay, seq_length, act_bytes, 0, in_flight[:-1],
                                      layers[:-1])),
               _stage_activations(model, lay, seq_length, act_bytes, mtp, in_flight[-1:],
                                  layers[-1:])[0])


def _stage_activations(model: ModelConfig, lay: Layout, seq_length: int, act_bytes: int,
                       mtp: int, in_flight: list[float], decoder_layers: list[int]
                       ) -> list[float]:
    """Saved activations of stages holding `decoder_layers[i]` decoder layers (the model's
    mean layer) plus `mtp` MTP layers, with `in_flight[i]` micro-batches, and the fp32
    logits with their gradient once per prediction (1 + D with MTP; charged to every stage,
    conservatively)."""
    h = model.hidden_size
    tokens = seq_length // lay.cp * lay.micro_batch_size
    recompute = recompute_config(lay.recompute)
    kept = recompute if recompute.granularity != "full" else recompute_config("none")
    per_layer = [layer_values(model, i, kept, tp=lay.tp, ep=lay.ep, etp=lay.etp,
                              act_bytes=act_bytes) for i in range(model.num_layers + mtp)]
    mean_layer = sum(per_layer) / len(per_layer)
    logits = 2 * 4 * model.vocab_size / lay.tp * (1 + mtp)
    out = []
    for n, flight in zip(decoder_layers, in_flight):
        layers_per_stage = n + mtp
        if recompute.granularity == "full":  # each layer's input, plus one being replayed
            stage = layers_per_stage * h / lay.tp + max(per_layer)
        else:
            stage = layers_per_stage * mean_layer
        out.append(tokens * act_bytes * (stage * flight) + tokens * logits)
    return out
