#!/usr/bin/env python
"""Parallel-layout planner: which (TP, PP, VPP, EP, ETP, DP, CP, distributed optimizer,
recompute, micro batch) fits a model on N GPUs, and how fast it should run.

    python tools/plan_parallel.py --config configs/mixtral-8x7b.yaml --gpus 64 \
        --gpu-memory-gb 80 [--gpus-per-node 8 --intra-node-gbps 450 --inter-node-gbps 50
        --peak-tflops 989 --global-batch-size 256 --json]

Memory per GPU = weights + gradients + optimizer states + activations of the micro-batches
in flight (1F1B keeps PP of them on the first stage) including the MoE dispatch buffers.
The static part follows megamoe's actual layout (stage_parameters / stage_bytes), checked
tensor by tensor against runs of configs/tiny.yaml under DP, ZeRO-1, TP+SP, PP, EP and
combinations (tests/tools/test_plan_parallel.py: exact to the byte): norms, routers,
row-parallel biases and shared experts are replicated over TP; routed experts are split
over EP only (ETP = TP keeps whole experts on each TP rank); a tied embedding has a copy on
the last stage; fp32 gradients are full size on every rank; the distributed optimizer
keeps 16 bytes per owned element (fp32 main slice, fp32 reduced-gradient slice, two Adam
moments) over DP for dense and expert-DP for expert parameters. Activations are checked
against autograd's saved tensors of one tiny fp32 forward (within 25%; measured -16%).
Step time = GEMM FLOPs at peak x efficiency + TP/SP collectives + EP all-to-all, stretched
by the pipeline bubble, + the gradient all-reduce and pipeline p2p. Link speeds are GB/s
per GPU; a group stays on NVLink when it fits in one node. Layouts the argument rules
would reject are never generated (divisibility of heads, query groups, layers, experts,
world size and global batch).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megamoe.config import ModelConfig  # noqa: E402
from megamoe.model.flops import (  # noqa: E402
    _attention_params,
    _ffn_params,
    _norm_params,
    flops_per_token,
)

GB = 1e9


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
    recompute: str  # none | full
    micro_batch_size: int


@dataclass
class Hardware:
    gpus: int
    gpu_memory_gb: float
    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0  # GB/s per GPU (NVLink 4: 450 GB/s each way)
    inter_node_gbps: float = 50.0  # GB/s per GPU (one 400 Gb/s NIC per GPU)
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    gemm_efficiency: float = 0.6  # fraction of peak large bf16 GEMMs reach


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _stage_of_layer(model: ModelConfig, lay: Layout, i: int) -> int:
    """Pipeline stage holding layer i: PP x VPP equal chunks, chunk c on stage c % PP."""
    per_chunk = model.num_layers // (lay.pp * lay.vpp)
    return (i // per_chunk) % lay.pp


def stage_parameters(model: ModelConfig, lay: Layout, stage: int) -> tuple[float, float]:
    """(dense, routed-expert) parameters one rank of pipeline stage `stage` holds.

    megamoe's layout: attention and dense-MLP matrices and the (padded) vocabulary are
    split over TP; norms, routers, row-parallel biases and shared experts are replicated
    over TP; routed experts are split over EP only (experts are not sharded over the
    expert-tensor-parallel ranks: --expert-tensor-parallel-size other than TP is not built,
    and ETP = TP keeps whole experts on every TP rank)."""
    h, norm = model.hidden_size, _norm_params(model)
    dense = expert = 0.0
    for i in range(model.num_layers):
        if _stage_of_layer(model, lay, i) != stage:
            continue
        attn, _ = _attention_params(model)
        proj_bias = h if model.add_bias_linear else 0
        dense += 2 * norm + (attn - proj_bias) / lay.tp + proj_bias
        if model.is_moe_layer(i):
            m = model.moe
            one_expert, _ = _ffn_params(model, m.ffn_hidden_size)
            dense += m.num_experts * h  # router
            if m.shared_expert_intermediate_size is not None:
                dense += _ffn_params(model, m.shared_expert_intermediate_size)[0]
                dense += h if m.shared_expert_gate else 0
            expert += m.num_experts * one_expert / lay.ep
        else:
            mlp, _ = _ffn_params(model, model.ffn_hidden_size)
            fc2_bias = h if model.add_bias_linear else 0
            dense += (mlp - fc2_bias) / lay.tp + fc2_bias
    vocab = math.ceil(model.padded_vocab_size / lay.tp) * h
    if stage == 0:
        dense += vocab
        if model.position_embedding_type == "learned_absolute":
            dense += model.max_position_embeddings * h
    if stage == lay.pp - 1:
        dense += norm  # final norm
        # The output layer; with tied embeddings the last stage keeps a copy of the word
        # embedding (only when it is not also the first stage).
        if model.untie_embeddings_and_output_weights or lay.pp > 1:
            dense += vocab
    return dense, expert


def stage_bytes(model: ModelConfig, lay: Layout, stage: int, param_bytes: int = 2
                ) -> dict[str, float]:
    """Weights, gradients and optimizer states of one rank of pipeline stage `stage`.

    Matches megamoe/parallel/optimizer.py and distributed_optimizer.py: gradients are
    accumulated in full-size fp32 tensors (fp32: the parameters' .grad; bf16: fp32 main
    grads, the bf16 .grad is freed by the accumulation hook). Without the distributed
    optimizer the states are two fp32 Adam moments, plus fp32 main parameters with bf16.
    With it, every rank keeps, for its 1/DP slice of the dense parameters (1/EDP of the
    experts): an fp32 main copy, an fp32 copy of the reduced gradient slice and the two
    moments, 16 bytes per element in fp32 and bf16 alike."""
    dense, expert = stage_parameters(model, lay, stage)
    params = dense + expert
    weights, grads = param_bytes * params, 4 * params
    if lay.distributed_optimizer:
        edp = max(lay.dp * lay.cp * lay.tp // (lay.etp * lay.ep), 1)
        opt = 16 * dense / (lay.dp * lay.cp) + 16 * expert / edp
    else:
        opt = (8 if param_bytes == 4 else 12) * params
    return {"weights": weights, "gradients": grads, "optimizer": opt, "parameters": params}


def model_bytes(model: ModelConfig, lay: Layout, param_bytes: int = 2) -> dict[str, float]:
    """Weights, gradients and optimizer states on the most loaded GPU (the largest stage)."""
    stages = [stage_bytes(model, lay, s, param_bytes) for s in range(lay.pp)]
    return max(stages, key=lambda b: b["weights"] + b["gradients"] + b["optimizer"])


def activation_bytes(model: ModelConfig, lay: Layout, seq_length: int, act_bytes: int = 2
                     ) -> float:
    """Saved activations on the first pipeline stage (it holds PP micro-batches in 1F1B)."""
    h, d = model.hidden_size, model.kv_channels
    nq, nkv = model.num_attention_heads, model.num_query_groups
    tokens = seq_length // lay.cp * lay.micro_batch_size
    attn = 3 * h + (nq + 2 * nkv) * d + 2 * nq * d  # norm/qkv/proj inputs, q k v, out + lse
    per_layer = []
    for i in range(model.num_layers):
        if model.is_moe_layer(i):
            m, f = model.moe, model.moe.ffn_hidden_size
            fc1 = 2 * f if model.swiglu else f
            # norm + router input, permuted tokens, fc1 out, act out, expert out (k copies),
            # plus the all-to-all send/receive buffers of the dispatch (k x h each way).
            expert = m.topk * (h + fc1 + f + h) / lay.etp + (2 * m.topk * h if lay.ep > 1 else 0)
            mlp = 2 * h + expert + m.num_experts * 4 / act_bytes  # fp32 router probs
        else:
            f = model.ffn_hidden_size
            fc1 = 2 * f if model.swiglu else f
            mlp = (2 * h + fc1 + f) / lay.tp
        per_layer.append(attn / lay.tp + mlp)
    layers_per_stage = model.num_layers / lay.pp
    mean_layer = sum(per_layer) / len(per_layer)
    if lay.recompute == "full":  # only each layer's input, plus one layer being recomputed
        stage = layers_per_stage * h / lay.tp + max(per_layer)
    else:
        stage = layers_per_stage * mean_layer
    in_flight = lay.pp if lay.pp > 1 else 1
    if lay.vpp > 1:
        in_flight = lay.pp + (lay.pp - 1) / lay.vpp
    logits = 2 * 4 * model.vocab_size / lay.tp  # fp32 logits and their gradient (last stage)
    return tokens * act_bytes * (stage * in_flight) + tokens * logits


def step_time(model: ModelConfig, lay: Layout, hw: Hardware, seq_length: int,
              global_batch_size: int) -> dict[str, float]:
    """Seconds per global batch, by component."""
    tokens = global_batch_size * seq_length
    flops = flops_per_token(model) * tokens / hw.gpus
    if lay.recompute == "full":
        flops *= 4 / 3  # one more forward
    # Sharded GEMMs are smaller and run further from peak: ~5% per doubling of TP / ETP.
    eff = hw.gemm_efficiency * (1 - 0.05 * math.log2(lay.tp)) * (1 - 0.03 * math.log2(lay.etp))
    compute = flops / (hw.peak_tflops * 1e12 * eff)

    def bw(group_span: int) -> float:  # collectives reach ~70% of the link's bandwidth
        link = hw.intra_node_gbps if group_span <= hw.gpus_per_node else hw.inter_node_gbps
        return 0.7 * link * GB

    h = model.hidden_size
    local_tokens = tokens / (lay.dp * lay.cp)  # tokens through one model replica's ranks
    layers_local = model.num_layers / lay.pp
    tp_comm = 0.0
    if lay.tp > 1:  # SP: all-gather + reduce-scatter around attention and MLP, fwd and bwd
        vol = 8 * local_tokens * h * 2 * (lay.tp - 1) / lay.tp / lay.tp
        tp_comm = vol * layers_local / bw(lay.tp)
    a2a = 0.0
    if model.moe is not None and lay.ep > 1:
        moe_local = sum(model.is_moe_layer(i) for i in range(model.num_layers)) / lay.pp
        # dispatch + combine, forward and backward: 4 all-to-alls of k copies of each token
        vol = 4 * model.moe.topk * local_tokens / lay.tp * h * 2 * (lay.ep - 1) / lay.ep
        a2a = vol * moe_local / bw(lay.ep * lay.etp)
    cp_comm = 0.0
    if lay.cp > 1:  # ring attention: K and V pass around the ring, forward and backward
        kv = 2 * model.num_query_groups * model.kv_channels
        cp_comm = 3 * local_tokens * kv * 2 * (lay.cp - 1) / lay.cp * layers_local / lay.tp \
            / bw(lay.tp * lay.cp)
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
    busy = compute + tp_comm + a2a + cp_comm
    total = busy * (1 + bubble) + dp_comm + p2p
    return {"total": total, "compute": compute, "tp_comm": tp_comm, "all_to_all": a2a,
            "cp_comm": cp_comm, "bubble": busy * bubble, "dp_comm": dp_comm, "p2p": p2p}


def legal_layouts(model: ModelConfig, gpus: int, global_batch_size: int, seq_length: int,
                  gpus_per_node: int) -> list[Layout]:
    """Every layout megamoe's argument rules accept for this model and world size."""
    out = []
    experts = model.moe.num_experts if model.moe else 1
    heads, groups = model.num_attention_heads, model.num_query_groups
    for tp, pp, cp in itertools.product(divisors(gpus_per_node), divisors(model.num_layers),
                                        (1, 2, 4)):
        if heads % tp or groups % tp or gpus % (tp * pp * cp) or seq_length % (2 * cp):
            continue
        dp = gpus // (tp * pp * cp)
        for vpp in (1, 2, 4):
            if vpp > 1 and (pp == 1 or model.num_layers % (pp * vpp)):
                continue
            for ep, etp in itertools.product(divisors(experts), sorted({1, tp})):
                if model.moe is None and (ep > 1 or etp != tp):
                    continue
                if (gpus // pp) % (ep * etp):  # expert-data-parallel size must be whole
                    continue
                for mbs, dist_opt, rec in itertools.product((1, 2, 4), (False, True),
                                                            ("none", "full")):
                    if global_batch_size % (mbs * dp) or (dist_opt and dp * cp == 1):
                        continue
                    out.append(Layout(tp, pp, vpp, ep, etp, dp, cp, dist_opt, rec, mbs))
    return out


def plan(model: ModelConfig, hw: Hardware, seq_length: int, global_batch_size: int,
         top: int = 5) -> list[dict]:
    """Layouts that fit, fastest first, each with its memory, time and a one-line reason."""
    results = []
    flops = flops_per_token(model) * global_batch_size * seq_length
    for lay in legal_layouts(model, hw.gpus, global_batch_size, seq_length, hw.gpus_per_node):
        mem = model_bytes(model, lay)
        act = activation_bytes(model, lay, seq_length)
        total_mem = mem["weights"] + mem["gradients"] + mem["optimizer"] + act
        if total_mem > 0.9 * hw.gpu_memory_gb * GB:  # keep 10% for allocator/NCCL buffers
            continue
        t = step_time(model, lay, hw, seq_length, global_batch_size)
        results.append({"layout": asdict(lay), "memory_gb": {
            "weights": mem["weights"] / GB, "gradients": mem["gradients"] / GB,
            "optimizer": mem["optimizer"] / GB, "activations": act / GB,
            "total": total_mem / GB},
            "step_time_s": t, "tflops_per_gpu": flops / t["total"] / hw.gpus / 1e12,
            "mfu": flops / t["total"] / hw.gpus / (hw.peak_tflops * 1e12)})
    results.sort(key=lambda r: (r["step_time_s"]["total"], r["memory_gb"]["total"]))
    for r in results[:top]:
        r["explanation"] = explain(r, hw)
    return results[:top]


def explain(r: dict, hw: Hardware) -> str:
    lay, t = r["layout"], r["step_time_s"]
    parts = sorted(((k, v) for k, v in t.items() if k != "total" and v > 0),
                   key=lambda kv: -kv[1])
    shares = ", ".join(f"{k} {100 * v / t['total']:.0f}%" for k, v in parts[:3])
    return (f"TP{lay['tp']} PP{lay['pp']} VPP{lay['vpp']} EP{lay['ep']} ETP{lay['etp']} "
            f"DP{lay['dp']} CP{lay['cp']} mbs{lay['micro_batch_size']}"
            f"{' distopt' if lay['distributed_optimizer'] else ''}"
            f"{' recompute' if lay['recompute'] == 'full' else ''}: "
            f"{r['memory_gb']['total']:.1f}/{hw.gpu_memory_gb:.0f} GB, "
            f"{t['total']:.2f} s/step, {r['tflops_per_gpu']:.0f} TFLOP/s/GPU ({shares})")


def load_model(config_path: str, vocab_size: int, seq_length: int | None) -> ModelConfig:
    from megamoe.arguments import config_file_to_argv, parse_args
    from megamoe.configs_from_args import args_to_configs

    argv = config_file_to_argv(config_path) + ["--dry-run"]
    if seq_length:
        argv += ["--seq-length", str(seq_length)]
    # The planner chooses the layout: drop flags the rules would reject only because the
    # feature is not built yet, so a preset can be planned before megamoe can run it.
    args = parse_args(argv, world_size=1, prog="plan_parallel.py")
    return args_to_configs(args, vocab_size).model


def main(argv: list[str] | None = None) -> int:
    from megamoe.arguments import OneLineArgumentParser

    p = OneLineArgumentParser(prog="plan_parallel.py", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a preset, e.g. configs/mixtral-8x7b.yaml")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-memory-gb", type=float, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s per GPU")
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--gemm-efficiency", type=float, default=0.6)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-length", type=int, default=None, help="default: the preset's")
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    for name in ("gpus", "gpu_memory_gb", "gpus_per_node", "global_batch_size", "top"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not os.path.isfile(a.config):
        p.error(f"--config: file not found: {a.config}")
    model = load_model(a.config, a.vocab_size, a.seq_length)
    hw = Hardware(a.gpus, a.gpu_memory_gb, a.gpus_per_node, a.intra_node_gbps,
                  a.inter_node_gbps, a.peak_tflops, a.gemm_efficiency)
    results = plan(model, hw, model.seq_length, a.global_batch_size, a.top)
    if a.json:
        print(json.dumps({"config": a.config, "gpus": a.gpus, "layouts": results}, indent=1))
    elif not results:
        print(f"no layout fits {a.gpus} x {a.gpu_memory_gb:.0f} GB")
    else:
        for i, r in enumerate(results, 1):
            print(f"{i}. {r['explanation']}")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
