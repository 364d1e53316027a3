"""One step that turns the single-process model into this rank's part of a parallel layout.

The model is built as one process would build it (plain `GPTModel(config)`, on the CPU with
the seed, or on the meta device), then `parallelize` applies, in this order:

  1. tensor + sequence parallelism: attention, dense MLP, shared experts, word embedding
     and output layer keep this TP rank's rows/columns (the layers' `shard`), norms,
     position embeddings and shared-expert gates fed by sequence shards are marked for
     the TP gradient sum, the modules that run TP collectives get the TP context (group,
     SP, dropout stream);
  2. pipeline parallelism: keep this rank's (virtual) stages of the TP-sharded model;
  2b. context parallelism: every attention gets the cp group and its layer's
     --cp-comm-type, every router the cp group (aux_loss / seq_aux_loss count tokens
     over the whole sequence), and the model a `context_parallel` (group, rank, size)
     that the schedules read to split each batch (training/cp_batch.py);
  3. experts (`parallelize_moe`): keep this ep rank's experts, this etp rank's slice of
     their hidden dimension, give every MoE layer the dispatcher of the layout (local,
     alltoall or allgather, inside a tensor-parallel one under TP), mark the expert
     parameters, and set the grouped-GEMM choice;
  4. adaptive parallelism: wrap each MoE layer's expert-parallel dispatcher in an adaptive
     one (times the collectives of the ep group once);
  5. the balancing group of global_aux_loss (dp x cp);
  6. the dropout streams: one per pipeline stage (and per TP rank for split activations);
  7. the dtype (bf16: the routers' expert bias stays fp32);
  8. activation recompute (--recompute-*): which layer groups (full) or modules
     (selective) of this rank's layers keep only their inputs (parallel/checkpointing.py);
  9. --compile: torch.compile each transformer layer in place (its parameters and state
     dict keys stay as they are).

Every step only slices, marks or wraps: the values of a shard are the single-process
values at the same global position, so every layout computes what one process computes.
Steps 1-3 work on meta tensors too (shapes only).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist
from torch import nn

from megamoe.config import MoEExecutionConfig, ParallelConfig, RecomputeConfig
from megamoe.config.fields import require
from megamoe.model.attention import SelfAttention
from megamoe.model.gpt_model import GPTEmbedding, GPTModel
from megamoe.model.mla import MLASelfAttention
from megamoe.model.mtp import MTPLayer, MultiTokenPrediction
from megamoe.model.norms import ProjectionRMSNorm
from megamoe.model.pipeline_stage import GPTStage, split_pipeline
from megamoe.model.transformer_block import TransformerBlock, TransformerLayer
from megamoe.moe.cost_model import CollectiveCosts
from megamoe.moe.dispatchers import (
    AdaptiveDispatcher,
    AllGatherDispatcher,
    AllToAllDispatcher,
    ExpertParallelDispatcher,
    LocalDispatcher,
    TensorParallelDispatcher,
)
from megamoe.moe.experts import GroupedExperts, SharedExpertMLP, use_grouped_gemm
from megamoe.moe.force_balance import expert_parallel_seed
from megamoe.moe.layer import MoELayer
from megamoe.moe.router import TopKRouter
from megamoe.moe.sharding import mark_expert_parallel, shard_expert_hidden, shard_experts
from megamoe.parallel.comm import group_rank, group_size
from megamoe.parallel.context_parallel import parse_cp_comm_type
from megamoe.parallel.mesh import Mesh
from megamoe.parallel.rng import MODEL_PARALLEL_SEED_OFFSET, PIPELINE_SEED_STRIDE, RNGTracker
from megamoe.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    mark_tp_partial,
)

Group = Optional[dist.ProcessGroup]


def parallelize(model: GPTModel, mesh: Mesh, parallel: ParallelConfig,
                moe: MoEExecutionConfig, *, seed: int,
                dtype: torch.dtype = torch.float32,
                recompute: Optional[RecomputeConfig] = None,
                compile_layers: bool = False) -> nn.Module:
    """This rank's part of `model` (a GPTModel, or with PP a PipelineModel of its stages),
    in the order of the module docstring. `seed` is --seed: the TP dropout stream and the
    per-stage dropout streams derive from it."""
    if mesh.tp_size > 1:
        rng = RNGTracker(seed + MODEL_PARALLEL_SEED_OFFSET + mesh.tp_rank)
        apply_tensor_parallel(model, TensorParallel(mesh.group("tp"), parallel.sequence_parallel,
                                                    rng, parallel.tp_comm))
    if mesh.pp_size > 1:
        model = split_pipeline(model, parallel.layer_ranges(model.config.num_layers,
                                                            model.config.num_mtp_layers),
                               mesh.pp_rank, mesh.group("pp"), mesh.group_ranks["pp"])
    if mesh.cp_size > 1:
        apply_context_parallel(model, mesh.group("cp"), parallel.cp_comm_type)
    if model.config.moe is not None:
        use_grouped_gemm(model, moe.grouped_gemm)
        parallelize_moe(model, ep_group=mesh.group("ep"), tp_group=mesh.group("tp"),
                        etp_group=mesh.group("etp"), execution=moe)
        if moe.adaptive_parallelism:
            enable_adaptive_parallelism(model, mesh.group("ep"), device=mesh.device)
        if mesh.dp_size * mesh.cp_size > 1:
            set_balancing_group(model, mesh.group("dp_cp"), mesh.dp_size * mesh.cp_size)
        if model.config.moe.force_load_balancing:
            set_force_balancing_rng(model, mesh, seed)
    if mesh.tp_size > 1 or mesh.pp_size > 1:  # this stage's dropout stream, every TP rank
        torch.manual_seed(seed + PIPELINE_SEED_STRIDE * mesh.pp_rank)
    if dtype != torch.float32:
        model = model.to(dtype)
    if recompute is not None:
        apply_recompute(model, recompute)
    if compile_layers:
        compile_transformer_layers(model)
    return model


def set_force_balancing_rng(model: nn.Module, mesh: Mesh, seed: int) -> None:
    """--moe-router-force-load-balancing: one noise stream per expert-parallel rank
    (Megatron's expert-parallel seed), shared by this rank's routers."""
    rng = RNGTracker(expert_parallel_seed(seed, mesh.local_rank_in("ep"), mesh.local_rank_in("etp"),
                                          PIPELINE_SEED_STRIDE * mesh.pp_rank))
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.force_rng = rng


def apply_context_parallel(model: nn.Module, group: Group, comm_types: list[str]) -> nn.Module:
    """Step 2b, in place: attention runs over the cp group (one --cp-comm-type value for
    all layers or one per layer, indexed by the layer's global index as Megatron; an MTP
    depth's layer, numbered after the decoder's, takes the last layer's, as its kind),
    and MTP shifts its targets across the cp ranks."""
    num_layers = model.config.num_layers
    types = parse_cp_comm_type(list(comm_types), num_layers)
    cp = (group, group_rank(group), group_size(group))
    for m in model.modules():
        if isinstance(m, TransformerLayer):
            m.self_attention.cp_group = group
            m.self_attention.cp_comm_type = types[min(m.layer_index, num_layers - 1)]
        if isinstance(m, TopKRouter):
            m.cp_group, m.cp_size = group, group_size(group)
        if isinstance(m, MultiTokenPrediction):
            m.cp = cp
    model.context_parallel = cp
    return model


def compile_transformer_layers(model: nn.Module) -> nn.Module:
    """Step 9, in place: `nn.Module.compile` on every transformer layer (attention, norms,
    the MLP or MoE layer with its router, permutation and grouped GEMMs). Compilation
    happens at the first call, per input shape. What the compiler cannot trace (a
    collective, a host read of the dispatch sizes, the routing statistics) runs eagerly
    between compiled pieces, so every layout and option works; the math is the eager
    math up to fp32 rounding (tests/training/test_compile.py)."""
    # Dropout and router jitter draw from the eager generators (the per-stage / TP streams
    # and the recompute replay rely on them), not inductor's own RNG.
    inductor_config.fallback_random = True
    for m in model.modules():
        if isinstance(m, TransformerLayer):
            m.compile()
    return model


def apply_recompute(model: nn.Module, recompute: RecomputeConfig) -> nn.Module:
    """Step 8, in place: full granularity gives each decoder block / pipeline chunk its
    checkpointed layer groups (uniform or block over its own layers, as Megatron per model
    chunk); selective switches on the named modules in every layer. Setting a config with
    nothing enabled switches recompute off."""
    selected = set(recompute.selected)
    for m in model.modules():
        if isinstance(m, (TransformerBlock, GPTStage)):
            m.recompute_groups = recompute.full_layers(len(m.layers))
        elif isinstance(m, MTPLayer):  # Megatron: uniform recomputes each MTP layer whole
            m.recompute = recompute.granularity == "full" and recompute.method == "uniform"
        elif isinstance(m, TransformerLayer):
            m.recompute_norms = "layernorm" in selected
            m.recompute_mlp = ("moe" if m.is_moe else "mlp") in selected
        elif isinstance(m, SelfAttention):
            m.recompute_core_attn = "core_attn" in selected
        elif isinstance(m, MLASelfAttention):
            m.recompute_core_attn = "core_attn" in selected
            m.recompute_up_proj = "mla_up_proj" in selected
        elif isinstance(m, MoELayer):
            m.recompute_shared = "shared_experts" in selected
            require(not (m.recompute_shared and m.shared_expert_overlap),
                    "--recompute-modules shared_experts cannot work with "
                    "--moe-shared-expert-overlap")
        elif isinstance(m, GroupedExperts):
            m.recompute_act = "moe_act" in selected
    return model


def apply_tensor_parallel(model: nn.Module, tp: TensorParallel) -> nn.Module:
    """Step 1, in place (returns `model`): shard the column/row-parallel linears and
    vocab-parallel tables, hand `tp` to the modules that run TP collectives or dropout on
    split activations, and (SP) mark the replicated parameters that see only this rank's
    sequence shard."""
    for m in list(model.modules()):
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            m.shard(tp)
        elif isinstance(m, (GPTModel, GPTEmbedding, TransformerLayer, SelfAttention,
                            MLASelfAttention, MTPLayer)):
            m.tp = tp
        if isinstance(m, MTPLayer):
            for norm in (m.enorm, m.hnorm, m.final_layernorm):
                mark_sequence_parallel(norm, tp)
        if isinstance(m, ProjectionRMSNorm):  # whole-projection q/k norm: TP-sharded
            m.shard(tp)
        elif isinstance(m, MLASelfAttention):  # replicated, run on sequence shards under SP
            for replicated in m.replicated_modules():
                mark_sequence_parallel(replicated, tp)
        elif isinstance(m, SelfAttention) and m.q_layernorm is not None \
                and not m.qk_norm_whole:
            mark_tp_partial(m.q_layernorm, tp)
            mark_tp_partial(m.k_layernorm, tp)
        if isinstance(m, SharedExpertMLP) and m.gate_weight is not None and tp.sp:
            m.gate_weight.sequence_parallel = True  # whole gate, run on the sequence shard
        if isinstance(m, TransformerLayer):
            mark_sequence_parallel(m.input_layernorm, tp)
            mark_sequence_parallel(m.pre_mlp_layernorm, tp)
        elif isinstance(m, TransformerBlock):
            mark_sequence_parallel(m.final_layernorm, tp)
        elif isinstance(m, GPTEmbedding) and m.position_embeddings is not None:
            mark_sequence_parallel(m.position_embeddings, tp)  # looks up its shard only
    return model


def _moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _expert_parallel_dispatcher(kind: str, num_experts: int, ep_group: Group,
                                overlap_degree: int) -> ExpertParallelDispatcher:
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, ep_group, overlap_degree)
    return AllGatherDispatcher(num_experts, ep_group)


def parallelize_moe(model: nn.Module, *, ep_group: Group = None, tp_group: Group = None,
                    etp_group: Group = None,
                    execution: Optional[MoEExecutionConfig] = None) -> nn.Module:
    """Step 3, in place, for every MoELayer of `model` (a GPT model or any module holding
    MoE layers, e.g. one standalone layer): keep this ep rank's experts and give the layer
    the expert-parallel dispatcher; under TP (sequence parallel) split the experts' hidden
    dimension over `etp_group` (ETP = TP) or the routed tokens over the TP ranks (ETP = 1)
    around it (moe/dispatchers/tensor_parallel.py), and shard the shared experts over
    `tp_group` unless step 1 did (a layer parallelized on its own). Returns `model`."""
    execution = execution or MoEExecutionConfig()
    ep, tp, etp = group_size(ep_group), group_size(tp_group), group_size(etp_group)
    for layer in _moe_layers(model):
        dispatcher = layer.dispatcher
        layer.config.check_expert_parallel(ep)
        execution.check_layout(ep, etp, expert_biases=_has_biases(layer.experts))
        if ep > 1:
            dispatcher = _expert_parallel_dispatcher(
                execution.token_dispatcher_type, layer.config.num_experts, ep_group,
                execution.a2a_overlap_degree)
            shard_experts(layer.experts, dispatcher.local_start, dispatcher.num_local_experts)
        shared = layer.shared_experts
        execution.check_shared_expert_overlap(shared is not None, layer.recompute_shared)
        layer.shared_expert_overlap = execution.shared_expert_overlap
        if tp > 1 and shared is not None and shared.linear_fc1.tp.size == 1:
            # A layer parallelized on its own (step 1 shards a whole model's): the MoE
            # layer under TP always takes sequence shards.
            apply_tensor_parallel(shared, TensorParallel(tp_group, sequence_parallel=True))
        if tp > 1 or etp > 1:  # after the ep slice, which makes new parameters
            shard_expert_hidden(layer.experts, etp, group_rank(etp_group))
            dispatcher = TensorParallelDispatcher(
                dispatcher, tp_group, etp_group if etp > 1 else None,
                capacity_per_shard=not layer.config.capacity_over_tp_gathered_sequence)
        mark_expert_parallel(layer.experts)
        layer.dispatcher = dispatcher
    return model


def _has_biases(experts: nn.Module) -> bool:
    return getattr(experts, "fc1_bias", None) is not None


def enable_adaptive_parallelism(model: nn.Module, group: Group, *, device: torch.device,
                                measure: bool = True) -> list[AdaptiveDispatcher]:
    """Step 4: every expert-parallel MoE layer of `model` runs each call as ep, dp or tp
    (moe/dispatchers/adaptive.py). With `measure`, the collectives of `group` are timed
    once (the alpha-beta model, logged) and each layer times its modes at the first call
    of every token count and keeps the fastest; otherwise the mode is "ep" unless a caller
    passes `parallel_mode=` / `adaptive_r=`. `device`: the mesh's, where the
    measurements' and the calibration's tensors are made (required: NCCL takes no host
    tensor)."""
    costs = CollectiveCosts.measure(group, device) if measure else None
    out = []
    for layer in _moe_layers(model):
        outer, inner = None, layer.dispatcher
        if isinstance(inner, TensorParallelDispatcher):
            outer, inner = inner, inner.inner
        if isinstance(inner, AdaptiveDispatcher):  # enabled again: new measurements
            inner = inner.inner
        if not isinstance(inner, ExpertParallelDispatcher):
            raise ValueError("--moe-adaptive-parallelism needs --expert-model-parallel-size > 1")
        adaptive = AdaptiveDispatcher(inner, LocalDispatcher.for_experts(layer.experts),
                                      layer.config.topk, layer.experts.fc2_weight.shape[1],
                                      costs, calibrate=measure)
        if outer is None:
            layer.dispatcher = adaptive
        else:
            outer.inner = adaptive
        out.append(adaptive)
    return out


def set_balancing_group(model: nn.Module, group: Group, grad_average_size: int) -> None:
    """Step 5: global_aux_loss sums token counts over the data-parallel ranks (dp x cp). TP
    ranks are left out: with sequence parallelism every TP rank routes the same gathered
    tokens. Gradients are averaged over dp x cp, which the loss compensates for."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.balancing_group = group
            module.grad_average_size = grad_average_size
