"""Which parallel layouts fit a model on N GPUs, and how fast each should run (the model
tools/plan_parallel.py prints, and `pretrain_gpt.py --dry-run` shares its memory part).

Memory per GPU = weights + gradients + optimizer states + the larger of the activations of
the micro-batches in flight (memory.py) and the distributed optimizer's step / checkpoint
save transients (optimizer_memory.py). Step time = GEMM FLOPs at peak x efficiency + TP/SP
collectives + EP all-to-all, stretched by the pipeline bubble, + the gradient all-reduce and
pipeline p2p. With FP8 on (an Fp8Config with a format) the GEMMs the FP8 policy
converts count at the FP8 peak (fp8_time.py), its copies count as activations
(fp8_memory.py), and each layout also reports its bf16 step time.
Link speeds are GB/s per GPU; a group stays on NVLink when it fits in one node. Only
layouts `pretrain_gpt.py` accepts are generated: each candidate must pass the run
config's own rules (RunConfig: divisibility of heads, query groups, hidden sizes, layers,
experts, world size and global batch, the pipeline's micro-batches, the recompute and
context-parallel rules, ...) and need no feature that is not built yet
(config/unsupported.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from megamoe.config import (
    ConfigError,
    Fp8Config,
    ModelConfig,
    MoEExecutionConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from megamoe.config.unsupported import is_built
from megamoe.model.flops import flops_per_token, recompute_flops_per_token
from megamoe.model.gpt_model import GPTModel
from megamoe.parallel.context_parallel import ring_bytes_per_layer
from megamoe.parallel.cp_a2a import a2a_bytes_per_layer
from megamoe.planning.activations import RECOMPUTE_MODES, recompute_config, recompute_flags
from megamoe.planning.calibration import H100_COMM_EFFICIENCY, H100_GEMM_EFFICIENCY
from megamoe.planning.fp8_memory import fp8_copy_bytes, fp8_primary_values
from megamoe.planning.fp8_time import check_fp8_peak, fp8_gemm_flops_per_token, fp8_on
from megamoe.planning.gpu_peaks import H100_SXM_BF16_TFLOPS, H100_SXM_FP8_TFLOPS
from megamoe.planning.memory import Layout, activation_bytes, model_bytes
from megamoe.planning.optimizer_memory import largest_stage_transients
from megamoe.planning.pipeline_balance import best_first_last, first_last_flags, imbalance

GB = 1e9


@dataclass
class Hardware:
    gpus: int
    gpu_memory_gb: float
    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0  # GB/s per GPU (NVLink 4: 450 GB/s each way)
    inter_node_gbps: float = 50.0  # GB/s per GPU (one 400 Gb/s NIC per GPU)
    peak_tflops: float = H100_SXM_BF16_TFLOPS  # dense bf16 (gpu_peaks.py)
    # Fractions of peak that large bf16 GEMMs and of link bandwidth that collectives
    # reach: fitted to published Megatron-Core runs (calibration.py).
    gemm_efficiency: float = H100_GEMM_EFFICIENCY
    comm_efficiency: float = H100_COMM_EFFICIENCY
    # Dense FP8 peak (gpu_peaks.py: NVIDIA's H100 SXM datasheet); None: no FP8 tensor cores
    peak_fp8_tflops: Optional[float] = H100_SXM_FP8_TFLOPS
    gpu: str = "H100"  # the name FP8 planning's refusal gives


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def step_time(model: ModelConfig, lay: Layout, hw: Hardware, seq_length: int,
              global_batch_size: int, fp8: Optional[Fp8Config] = None) -> dict[str, float]:
    """Seconds per global batch of exactly `lay`, by component (modelled, not measured:
    linear in 1 / gemm_efficiency and 1 / comm_efficiency, which calibrate_planner.py
    uses to fit them). With FP8 on, the FP8 GEMMs' FLOPs run at hw.peak_fp8_tflops at the
    same efficiency (fp8_time.py); off, exactly the bf16 model."""
    tokens = global_batch_size * seq_length
    flops = flops_per_token(model) * tokens / hw.gpus
    # What recompute replays: one more forward of the recomputed modules.
    recompute = recompute_config(lay.recompute)
    flops += recompute_flops_per_token(model, recompute) * tokens / hw.gpus
    # Sharded GEMMs are smaller and run further from peak: ~5% per doubling of TP / ETP.
    eff = hw.gemm_efficiency * (1 - 0.05 * math.log2(lay.tp)) * (1 - 0.03 * math.log2(lay.etp))
    compute = flops / (hw.peak_tflops * 1e12 * eff)
    if fp8_on(fp8):
        fp8_flops = fp8_gemm_flops_per_token(model, recompute, fp8) * tokens / hw.gpus
        peak_fp8 = check_fp8_peak(hw.peak_fp8_tflops, hw.gpu)
        compute = ((flops - fp8_flops) / (hw.peak_tflops * 1e12 * eff)
                   + fp8_flops / (peak_fp8 * 1e12 * eff))

    def bw(group_span: int) -> float:  # collectives reach comm_efficiency of the link
        link = hw.intra_node_gbps if group_span <= hw.gpus_per_node else hw.inter_node_gbps
        return hw.comm_efficiency * link * GB

    h = model.hidden_size
    local_tokens = tokens / (lay.dp * lay.cp)  # tokens through one model replica's ranks
    layers_local = model.num_layers / lay.pp
    tp_comm = 0.0
    if lay.tp > 1:  # SP: all-gather + reduce-scatter around attention and MLP, fwd and bwd
        pairs = 2 * layers_local  # ... and around the shared experts of each MoE layer
        if model.moe is not None and model.moe.shared_expert_intermediate_size is not None:
            pairs += sum(model.is_moe_layer(i) for i in range(model.num_layers)) / lay.pp
        vol = 4 * pairs * local_tokens * h * 2 * (lay.tp - 1) / lay.tp / lay.tp
        tp_comm = vol / bw(lay.tp)
    a2a = 0.0
    if model.moe is not None and lay.ep > 1:
        moe_local = sum(model.is_moe_layer(i) for i in range(model.num_layers)) / lay.pp
        # dispatch + combine, forward and backward: 4 all-to-alls of k copies of each token
        vol = 4 * model.moe.topk * local_tokens / lay.tp * h * 2 * (lay.ep - 1) / lay.ep
        a2a = vol * moe_local / bw(lay.ep * lay.etp)
        if recompute.granularity == "full" or "moe" in recompute.selected:
            a2a *= 1.5  # the replayed forward runs dispatch and combine again
    cp_comm = 0.0
    if lay.cp > 1:  # the real volume of the p2p ring (parallel/context_parallel.py) or of
        # the a2a exchanges (parallel/cp_a2a.py), counted as not overlapped (upper bound)
        replay = recompute.granularity == "full" or "core_attn" in recompute.selected
        heads, k_dim, v_dim = _cp_kv_dims(model)
        if lay.cp_comm_type == "a2a":
            vol = a2a_bytes_per_layer(model.num_attention_heads, heads, k_dim, v_dim,
                                      local_tokens, lay.cp, lay.tp, recompute_forward=replay)
        else:
            vol = ring_bytes_per_layer(heads, k_dim, local_tokens, lay.cp, lay.tp,
                                       recompute_forward=replay, v_channels=v_dim)
        cp_comm = vol * layers_local / bw(lay.tp * lay.cp)
    m = global_batch_size // (lay.micro_batch_size * lay.dp)
    bubble = (lay.pp - 1) / (lay.vpp * m) if lay.pp > 1 else 0.0
    p2p = 0.0
    if lay.pp > 1:
        p2p = 2 * m * lay.vpp * (seq_length / lay.cp * lay.micro_batch_size * h * 2 / lay.tp) \
            / bw(hw.gpus_per_node + 1)
    mem = model_bytes(model, lay)
    dp_comm = 0.0
    if lay.dp * lay.cp > 1:  # fp32 gradient reduce (+ bf16 param gather): not overlapped
        grad_bytes = mem["gradients"] * (1.25 if lay.distributed_optimizer else 1.0)
        dp_comm = 2 * grad_bytes * (lay.dp * lay.cp - 1) / (lay.dp * lay.cp) / bw(
            lay.tp * lay.pp * lay.dp * lay.cp)
    # The pipeline runs at its busiest rank's pace (pipeline_balance.py: the last rank
    # also runs the output layer; an uneven split moves layers to even that out).
    busy = (compute + tp_comm + a2a + cp_comm) * imbalance(model, lay.pp, lay.vpp, lay.split)
    total = busy * (1 + bubble) + dp_comm + p2p
    return {"total": total, "compute": compute, "tp_comm": tp_comm, "all_to_all": a2a,
            "cp_comm": cp_comm, "bubble": busy * bubble, "dp_comm": dp_comm, "p2p": p2p}


def _cp_kv_dims(model: ModelConfig) -> tuple[int, int, int]:
    """(K/V heads, K head dim, V head dim) the CP ops carry per token. MLA: every
    head's K (its shared k_pe expanded per head, as core attention gets it), qk + pe
    channels, and v_head_dim V channels."""
    if model.multi_latent_attention:
        return (model.num_attention_heads, model.qk_head_dim + model.qk_pos_emb_head_dim,
                model.v_head_dim)
    return model.num_query_groups, model.kv_channels, model.kv_channels


def _recompute_modes(model: ModelConfig) -> list[str]:
    """The recompute modes worth ranking (activations.RECOMPUTE_MODES, the MoE ones only
    for a MoE model)."""
    return [name for name in RECOMPUTE_MODES if model.moe is not None or "moe" not in name]


def rules_accept(model: ModelConfig, lay: Layout, gpus: int, global_batch_size: int,
                 fp8: Optional[Fp8Config] = None) -> bool:
    """Whether the run config's rules accept `lay` for this model (what pretrain_gpt.py
    checks after its flags: the same RunConfig validation), with sequence parallelism
    under TP as MoE needs, and every feature the layout uses built."""
    return layout_run(model, lay, gpus, global_batch_size, fp8) is not None


def layout_run(model: ModelConfig, lay: Layout, gpus: int, global_batch_size: int,
               fp8: Optional[Fp8Config] = None) -> Optional[RunConfig]:
    """The RunConfig of `lay` (with `fp8`'s FP8 flags), None when its rules refuse it."""
    if (lay.cp > 1 and not is_built("--context-parallel-size")) or (
            lay.recompute != "none" and not is_built("--recompute-granularity")):
        return None
    moe = model.moe is not None  # (the planner assumes --moe-grouped-gemm: moe_act needs it)
    vpp_layers = None if lay.vpp == 1 else model.num_layers // (lay.pp * lay.vpp)
    first, last = _first_last(lay)
    try:
        return RunConfig(model, parallel=ParallelConfig(
            tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
            context_parallel_size=lay.cp, cp_comm_type=[lay.cp_comm_type],
            expert_model_parallel_size=lay.ep,
            expert_tensor_parallel_size=lay.etp, sequence_parallel=lay.tp > 1,
            use_distributed_optimizer=lay.distributed_optimizer, world_size=gpus,
            num_layers_per_virtual_pipeline_stage=vpp_layers,
            decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last),
            train=TrainConfig(micro_batch_size=lay.micro_batch_size,
                              global_batch_size=global_batch_size, train_iters=1),
            moe_execution=MoEExecutionConfig(grouped_gemm=moe),
            recompute=recompute_config(lay.recompute), fp8=fp8 or Fp8Config())
    except ConfigError:
        return None


def _first_last(lay: Layout) -> tuple[Optional[int], Optional[int]]:
    """The --decoder-first/last-pipeline-num-layers values of a planned uneven split."""
    if lay.split is None:
        return None, None
    values = {f.split("=")[0]: int(f.split("=")[1]) for f in first_last_flags(lay.split)}
    return (values.get("--decoder-first-pipeline-num-layers"),
            values.get("--decoder-last-pipeline-num-layers"))


def layout_flags(model: ModelConfig, lay: Layout) -> list[str]:
    """The pretrain_gpt.py flags that launch `lay` (Megatron-LM's names)."""
    flags = [f"--tensor-model-parallel-size={lay.tp}", f"--pipeline-model-parallel-size={lay.pp}",
             f"--expert-model-parallel-size={lay.ep}", f"--expert-tensor-parallel-size={lay.etp}",
             f"--micro-batch-size={lay.micro_batch_size}"]
    if lay.tp > 1:
        flags.append("--sequence-parallel")
    if lay.cp > 1:
        flags.append(f"--context-parallel-size={lay.cp}")
        if lay.cp_comm_type != "p2p":
            flags.append(f"--cp-comm-type={lay.cp_comm_type}")
    if lay.vpp > 1:
        layers = model.num_layers // (lay.pp * lay.vpp)
        flags.append(f"--num-layers-per-virtual-pipeline-stage={layers}")
    if lay.split is not None:
        flags += first_last_flags(lay.split)
    if lay.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if model.moe is not None:
        flags.append("--moe-grouped-gemm")
    return flags + recompute_flags(lay.recompute)


def legal_layouts(model: ModelConfig, gpus: int, global_batch_size: int, seq_length: int,
                  gpus_per_node: int, fp8: Optional[Fp8Config] = None) -> list[Layout]:
    """Every layout megamoe's argument rules accept for this model and world size: the
    candidates (TP within a node; the sizes that multiply to the world size), kept when
    `rules_accept` them; with CP each layout once with the p2p ring and once with a2a
    where its heads split over CP."""
    out = []
    experts = model.moe.num_experts if model.moe else 1
    pps = [pp for pp in divisors(gpus) if pp <= model.num_layers]
    uneven = {pp: best_first_last(model, pp) for pp in pps}
    for tp, pp, cp in itertools.product(divisors(gpus_per_node), pps, (1, 2, 4)):
        if gpus % (tp * pp * cp) or seq_length % (2 * cp):  # (CP: 2 x CP sequence chunks)
            continue
        dp = gpus // (tp * pp * cp)
        splits = [(vpp, None) for vpp in (1, 2, 4)
                  if model.num_layers % (pp * vpp) == 0 and (vpp == 1 or pp > 1)]
        if uneven[pp] is not None:  # the balanced first/last split (no interleaving)
            splits.append((1, uneven[pp]))
        for vpp, split in splits:
            for ep, etp in itertools.product(divisors(experts), sorted({1, tp})):
                if model.moe is None and (ep > 1 or etp != tp):
                    continue
                for mbs, dist_opt, rec in itertools.product((1, 2, 4), (False, True),
                                                            _recompute_modes(model)):
                    if dist_opt and dp * cp == 1:
                        continue
                    lay = Layout(tp, pp, vpp, ep, etp, dp, cp, dist_opt, rec, mbs,
                                 split=split)
                    if not rules_accept(model, lay, gpus, global_batch_size, fp8):
                        continue
                    out.append(lay)
                    a2a = replace(lay, cp_comm_type="a2a")  # where the heads split over CP
                    if cp > 1 and rules_accept(model, a2a, gpus, global_batch_size, fp8):
                        out.append(a2a)
    return out


def plan(model: ModelConfig, hw: Hardware, seq_length: int, global_batch_size: int,
         top: int = 5, fp8: Optional[Fp8Config] = None) -> list[dict]:
    """Layouts that fit, fastest first, each with its memory, time and a one-line reason.
    With FP8 on: ranked by the FP8 step time, the FP8 copies in the activations, and each
    layout's bf16 total as "step_time_bf16_s"."""
    results = []
    flops = flops_per_token(model) * global_batch_size * seq_length
    if fp8_on(fp8):
        check_fp8_peak(hw.peak_fp8_tflops, hw.gpu)
        with torch.device("meta"):  # the FP8 copies are counted on the model's shapes
            meta = GPTModel(model)
        fp8_cache: dict = {}
    for lay in legal_layouts(model, hw.gpus, global_batch_size, seq_length, hw.gpus_per_node,
                             fp8):
        mem = model_bytes(model, lay)
        lay_run = (layout_run(model, lay, hw.gpus, global_batch_size, fp8)
                   if fp8_on(fp8) and fp8.param_gather else None)
        if lay_run is not None:  # FP8 weights: 1 byte per value, not bf16's 2
            mem["weights"] -= fp8_primary_values(lay_run, meta, cache=fp8_cache)
        act = activation_bytes(model, lay, seq_length)
        transient = largest_stage_transients(model, lay)
        opt_peak = max(transient["step"], transient["save_device"])
        # Activations are freed before the optimizer steps and a checkpoint is saved.
        total_mem = mem["weights"] + mem["gradients"] + mem["optimizer"] + max(act, opt_peak)
        if fp8_on(fp8) and total_mem <= 0.9 * hw.gpu_memory_gb * GB:  # (copies only add)
            lay_run = lay_run or layout_run(model, lay, hw.gpus, global_batch_size, fp8)
            act += fp8_copy_bytes(lay_run, meta, cache=fp8_cache)
            total_mem = (mem["weights"] + mem["gradients"] + mem["optimizer"]
                         + max(act, opt_peak))
        if total_mem > 0.9 * hw.gpu_memory_gb * GB:  # keep 10% for allocator/NCCL buffers
            continue
        t = step_time(model, lay, hw, seq_length, global_batch_size, fp8)
        results.append({"layout": asdict(lay), "memory_gb": {
            "weights": mem["weights"] / GB, "gradients": mem["gradients"] / GB,
            "optimizer": mem["optimizer"] / GB, "activations": act / GB,
            "optimizer_transient": opt_peak / GB, "total": total_mem / GB},
            "step_time_s": t, "tflops_per_gpu": flops / t["total"] / hw.gpus / 1e12,
            "mfu": flops / t["total"] / hw.gpus / (hw.peak_tflops * 1e12)})
    results.sort(key=lambda r: (r["step_time_s"]["total"], r["memory_gb"]["total"]))
    for r in results[:top]:
        if fp8_on(fp8):  # the same layout in bf16, for comparison
            r["step_time_bf16_s"] = step_time(model, Layout(**r["layout"]), hw, seq_length,
                                              global_batch_size)["total"]
        r["explanation"] = explain(r, hw)
        r["flags"] = " ".join(layout_flags(model, Layout(**r["layout"])))
    return results[:top]


def explain(r: dict, hw: Hardware) -> str:
    lay, t = r["layout"], r["step_time_s"]
    parts = sorted(((k, v) for k, v in t.items() if k != "total" and v > 0),
                   key=lambda kv: -kv[1])
    shares = ", ".join(f"{k} {100 * v / t['total']:.0f}%" for k, v in parts[:3])
    split = lay.get("split")
    pp = f"PP{lay['pp']}" if split is None else \
        f"PP{lay['pp']} (layers {split[0]}/{split[1]}/.../{split[-1]})" if lay["pp"] > 2 else \
        f"PP{lay['pp']} (layers {split[0]}/{split[1]})"
    return (f"TP{lay['tp']} {pp} VPP{lay['vpp']} EP{lay['ep']} ETP{lay['etp']} "
            f"DP{lay['dp']} CP{lay['cp']}{' a2a' if lay['cp_comm_type'] == 'a2a' else ''} "
            f"mbs{lay['micro_batch_size']}"
            f"{' distopt' if lay['distributed_optimizer'] else ''}"
            f"{'' if lay['recompute'] == 'none' else ' recompute ' + lay['recompute']}: "
            f"{r['memory_gb']['total']:.1f}/{hw.gpu_memory_gb:.0f} GB, "
            f"modelled {t['total']:.2f} s/step{_bf16_note(r)}, "
            f"{r['tflops_per_gpu']:.0f} TFLOP/s/GPU "
            f"({shares})")


def _bf16_note(r: dict) -> str:
    """" in FP8 (bf16 X s)" next to an FP8 plan's step time; "" without FP8."""
    bf16 = r.get("step_time_bf16_s")
    return "" if bf16 is None else f" in FP8 (bf16 {bf16:.2f} s)"
