"""Transient memory of the distributed optimizer (--use-distributed-optimizer) on top of
memory.py's static bytes, per rank of a pipeline stage (upper bounds over its ranks): one
optimizer step and one torch_dist checkpoint save. Follows training/optim/flat_shards.py,
training/optim/distributed.py and training/checkpoint/dist.py; checked against measured
peaks by tests/parallel/test_distributed_optimizer_memory.py.

Notation, per shard group g (dense parameters over dp, routed experts over edp): N_g the
elements of the stage's parameters on this rank, S_g = N_g / group size the shard, P_g the
largest single parameter, k the saved states per element (exp_avg, exp_avg_sq, + the fp32
main for a bf16 model).

Step. The gradients are reduce-scattered in place in the flat fp32 grad buffer and the
parameters all-gathered in place in the flat model-dtype param buffer: no full-size copy.
What remains:
  - AdamW's temporaries: none on a GPU, where megamoe runs Adam fused (torch's fused AdamW
    or apex's FusedAdam update in place: training/optim/common.py); with torch's foreach
    implementation (`fused_adam=False`) one fp32 tensor per main piece, the whole shard:
    4 (S_dense + S_expert). (The CPU for-loop keeps at most three piece-size temporaries.)
  - with TP (sequence parallel): one flat fp32 bucket of the TP-replicated gradients
    (norms, routers, row-parallel biases) summed over TP;
  - the largest piece's squared gradient for the norm, freed at once;
  - with the precision-aware optimizer (state_precision.py): the moments stored below fp32
    are upcast to fp32 for the update, (8 - stored moment bytes) S in all, and bf16 main
    gradients to an fp32 copy, 4 S.
Save. A parameter is saved by the rank holding its first element, so a rank saves the
parameters that start in its shard, at most min(N_g, S_g + P_g) elements per group, and
assembles at most one of them (the one crossing its shard's end) from the other holders:
  - device: the assembled parameter's states, 4 k P_g per sharded group;
  - host: torch.distributed.checkpoint's writer copies every saved tensor to host memory
    and keeps the copies until the rank's file is written (an async save makes the same
    copies on the training thread and holds them until the next save):
    (param bytes + 4 k) x min(N_g, S_g + P_g) per group (4 bytes per state: an upper
    bound where a precision-aware run saves its bf16 moments in bf16).
On a GPU run the host copies are not device memory. On CPU (the tests) both share one
memory, and the assembled states are among the saved tensors: the peak is the host term
(+ copies of an assembled parameter's split parts, e.g. swiglu experts' gate / up).
"""

from __future__ import annotations

import math

from megamoe.config import ModelConfig
from megamoe.model.flops import _norm_params, attention_tp_replicated, largest_attention_weight
from megamoe.planning.memory import (
    FP32_STATES,
    Layout,
    StateBytes,
    _stage_of_layer,
    stage_parameters,
)


def _largest_parameters(model: ModelConfig, lay: Layout, stage: int) -> tuple[int, int]:
    """(dense, routed-expert) element count of the largest single parameter one rank of
    `stage` holds (layout as in memory.stage_parameters; a layer's local experts are one
    stacked tensor per weight, moe/experts.py GroupedExperts)."""
    h = model.hidden_size
    dense = [_norm_params(model)]
    expert = [0]
    if stage == 0 or stage == lay.pp - 1:
        dense.append(math.ceil(model.padded_vocab_size / lay.tp) * h)
    for i in range(model.num_layers):
        if _stage_of_layer(model, lay, i) != stage:
            continue
        dense.append(largest_attention_weight(model, lay.tp))
        if model.is_moe_layer(i):
            m = model.moe
            dense.append(m.num_experts * h)
            if m.shared_expert_intermediate_size is not None:
                width = m.shared_expert_intermediate_size
                dense.append((2 if model.gated_linear_unit else 1) * width * h)
            fc1_one = (2 if model.gated_linear_unit else 1) * m.ffn_hidden_size * h // lay.etp
            expert.append(m.num_experts // lay.ep * fc1_one)  # fc1 of the stacked experts
        else:
            dense.append((2 if model.gated_linear_unit else 1) * model.ffn_hidden_size * h
                         // lay.tp)
    return max(dense), max(expert)


def _tp_replicated(model: ModelConfig, lay: Layout, stage: int) -> int:
    """Elements of the stage's TP-replicated dense parameters whose gradients are summed
    over TP under sequence parallelism (norms, routers, row-parallel biases, MLA's down
    projections and latent norms)."""
    if lay.tp == 1:
        return 0
    h, norm = model.hidden_size, _norm_params(model)
    n = norm if stage == lay.pp - 1 else 0
    for i in range(model.num_layers):
        if _stage_of_layer(model, lay, i) == stage:
            n += 2 * norm + (2 * h if model.add_bias_linear else 0)
            n += attention_tp_replicated(model)  # MLA: run on sequence shards
            n += model.moe.num_experts * h if model.is_moe_layer(i) else 0
    return n


def shard_groups(model: ModelConfig, lay: Layout, stage: int) -> list[tuple[int, int, int]]:
    """(N, S, P) of the dense and the expert shard group (see the module docstring)."""
    dense, expert = stage_parameters(model, lay, stage)
    edp = max(lay.dp * lay.cp * lay.tp // (lay.etp * lay.ep), 1)
    p_dense, p_expert = _largest_parameters(model, lay, stage)
    out = []
    for n, size, p in ((dense, lay.dp * lay.cp, p_dense), (expert, edp, p_expert)):
        if n:
            out.append((int(n), math.ceil(n / size), min(p, int(n))))
    return out


def optimizer_transient_bytes(model: ModelConfig, lay: Layout, stage: int,
                              param_bytes: int = 2, fused_adam: bool = True,
                              states: StateBytes = FP32_STATES) -> dict[str, float]:
    """{"step", "save_device", "save_host"}: bytes one rank of `stage` allocates on top of
    memory.stage_bytes during an optimizer step and a torch_dist save (zeros without the
    distributed optimizer, which this does not model). `fused_adam`: Adam updates in
    place (megamoe on a GPU); else torch's foreach temporaries."""
    if not lay.distributed_optimizer:
        return {"step": 0.0, "save_device": 0.0, "save_host": 0.0}
    groups = shard_groups(model, lay, stage)
    k = 2 if param_bytes == 4 else 3
    shard = sum(s for _, s, _ in groups)
    adam = 0 if fused_adam else 4 * shard
    adam += (8 - states.exp_avg - states.exp_avg_sq) * shard  # precision-aware upcasts
    adam += (4 if states.main_grad < 4 else 0) * shard
    largest_piece = max((min(s, p) for _, s, p in groups), default=0)
    step = max(adam, 4 * _tp_replicated(model, lay, stage), 4 * largest_piece)
    device = sum(4 * k * p for n, s, p in groups if s < n)
    host = sum((param_bytes + 4 * k) * min(n, s + p) for n, s, p in groups)
    return {"step": float(step), "save_device": float(device), "save_host": float(host)}


def largest_stage_transients(model: ModelConfig, lay: Layout, param_bytes: int = 2,
                             states: StateBytes = FP32_STATES) -> dict[str, float]:
    """optimizer_transient_bytes' largest value of each kind over the pipeline stages."""
    stages = [optimizer_transient_bytes(model, lay, s, param_bytes, states=states)
              for s in range(lay.pp)]
    return {k: max(t[k] for t in stages) for k in stages[0]}
