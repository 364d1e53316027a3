#!/usr/bin/env python
"""Where one training step's time goes: torch.profiler under megamoe's modules, by category,
next to the step's FLOP floor.

Runs the iteration tools/bench_train_step.py times (same shape and flags; --megamoe-flags
adds any pretrain_gpt.py flag), warms up, then profiles --steps steps. Each operator's own
(self) CPU time goes to one category:
  attention        the SDPA kernel (scores, softmax, x V), forward and backward
  dense_gemm       GEMMs of the QKV / output projections, dense MLPs, shared experts and
                   the output layer
  expert_gemm      the routed experts' grouped GEMMs
  router           gating GEMM, scores, top-k, balancing losses
  permute          the MoE layer's token permutation, capacity, all-to-all bookkeeping and
                   combine (everything in the MoE layer outside router and experts)
  norms            RMSNorm / LayerNorm
  elementwise      SwiGLU, RoPE, residual adds, dropout, copies inside layers
  embedding, loss  the embedding lookup; the cross entropy
  optimizer        zero_grad, gradient reduction hooks, clipping, AdamW, copies back
  communication    torch.distributed operators
  statistics       per-step MoE loss / expert-load reports and the logged scalars
  host_syncs       device->host reads (.item(), .tolist()): their own time; also counted
  other            operators outside any of the above
  python           the step's wall time no operator accounts for (interpreter, hooks)
The forward category of an operator is the innermost megamoe module (or labelled phase)
that ran it; a backward operator inherits its forward operator's category through
autograd's sequence number. Prints one JSON object (--json) with seconds and shares per
step, the top operators, and the floor (the step's GEMM FLOPs at this machine's GEMM rate
plus the optimizer step alone, as bench_train_step.py).

    python tools/profile_step.py --json [--steps 3] [--megamoe-flags "--recompute-..."]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megamoe.model.gpt_model as gpt_model  # noqa: E402
import megamoe.training.loop as loop  # noqa: E402
from megamoe.model.attention import SelfAttention  # noqa: E402
from megamoe.model.gpt_model import GPTEmbedding  # noqa: E402
from megamoe.model.mla import MLASelfAttention  # noqa: E402
from megamoe.model.mlp import MLP  # noqa: E402
from megamoe.model.norms import LayerNorm, RMSNorm  # noqa: E402
from megamoe.model.transformer_block import TransformerLayer  # noqa: E402
from megamoe.moe.experts import GroupedExperts, SequentialExperts, SharedExpertMLP  # noqa: E402
from megamoe.moe.layer import MoELayer  # noqa: E402
from megamoe.moe.router import TopKRouter  # noqa: E402
from megamoe.parallel.linear import Linear  # noqa: E402
from megamoe.parallel.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
)
from tools.bench_train_step import (  # noqa: E402
    SHAPE,
    MegamoeSide,
    gemm_rate,
    optimizer_seconds,
    step_gemm_flops,
    time_steps,
)

PREFIX = "megamoe/"
MODULE_LABELS = (  # innermost wins; order only matters for subclasses
    ((ColumnParallelLinear, RowParallelLinear, Linear), "dense_gemm"),
    ((RMSNorm, LayerNorm), "norms"),
    ((TopKRouter,), "router"),
    ((GroupedExperts, SequentialExperts), "expert_gemm"),
    ((SharedExpertMLP, MLP, TransformerLayer), "elementwise"),
    ((MoELayer,), "permute"),
    ((SelfAttention, MLASelfAttention), "elementwise"),
    ((GPTEmbedding,), "embedding"),
)
GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::baddbmm",
         "aten::addbmm"}
SYNCS = {"aten::_local_scalar_dense", "aten::item"}  # their time; the read itself:
HOST_READ = "aten::_local_scalar_dense"  # (.item() calls it: count it once)
CATEGORIES = ("attention", "dense_gemm", "expert_gemm", "router", "permute", "norms",
              "elementwise", "embedding", "loss", "optimizer", "communication", "statistics",
              "host_syncs", "other", "python")


def _labelled(fn, label: str):
    def run(*args, **kwargs):
        with record_function(PREFIX + label):
            return fn(*args, **kwargs)
    return run


def instrument(side: MegamoeSide) -> None:
    """Label the model's modules and the step's phases (this process only: a profiling
    run, not the product's code path)."""
    for m in side.model.modules():
        for classes, label in MODULE_LABELS:
            if isinstance(m, classes):
                m.forward = _labelled(m.forward, label)
                break
        if isinstance(m, TopKRouter):  # the MoE layer calls route(), not forward()
            m.route = _labelled(m.route, "router")
    gpt_model.lm_head = _labelled(gpt_model.lm_head, "loss")
    for name in ("_moe_scalars", "_dp_mean_on_device", "update_expert_biases"):
        setattr(loop, name, _labelled(getattr(loop, name), "statistics"))
    side.observer.after_step = _labelled(side.observer.after_step, "statistics")
    opt = side.optimizer
    opt.step = _labelled(opt.step, "optimizer")
    opt.zero_grad = _labelled(opt.zero_grad, "optimizer")


def _refine(label: str, name: str) -> str:
    """An operator's category from its context label and its own name."""
    if name in SYNCS:
        return "host_syncs"
    if name.startswith(("c10d::", "gloo:", "nccl:")):
        return "communication"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    gemm = name in GEMMS
    if label in ("dense_gemm", "loss"):
        return "dense_gemm" if gemm else ("loss" if label == "loss" else "elementwise")
    if label == "expert_gemm":
        return "expert_gemm" if gemm else "elementwise"
    return label


def categorize(events) -> tuple[dict[str, float], dict[str, float], int]:
    """(seconds per category, seconds per operator name, host reads) over `events`."""
    by_id = {}
    label_of_seq: dict[int, str] = {}

    def context(e) -> str:
        p = e
        while p is not None:
            if p.name.startswith(PREFIX):
                return p.name[len(PREFIX):]
            if p.name.startswith("autograd::engine::evaluate_function"):
                return label_of_seq.get(p.sequence_nr, "other")
            p = p.cpu_parent
        return "other"

    ordered = sorted(events, key=lambda e: e.time_range.start)
    for e in ordered:  # forward operators first give their sequence numbers a label
        by_id[id(e)] = e
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::") \
                and e.sequence_nr not in label_of_seq:
            label_of_seq[e.sequence_nr] = context(e)
    seconds: dict[str, float] = defaultdict(float)
    per_op: dict[str, float] = defaultdict(float)
    syncs = 0
    for e in ordered:
        if e.name.startswith(PREFIX) or e.name.startswith("autograd::engine"):
            continue  # ranges, not operators (their own time is bookkeeping)
        own = e.self_cpu_time_total / 1e6
        cat = _refine(context(e), e.name)
        seconds[cat] += own
        per_op[f"{cat}:{e.name}"] += own
        syncs += e.name == HOST_READ
    return dict(seconds), dict(per_op), syncs


def profile(side: MegamoeSide, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            side.step()
        wall = (time.perf_counter() - start) / steps
    seconds, per_op, syncs = categorize(prof.events())
    seconds = {k: v / steps for k, v in seconds.items()}
    seconds["python"] = max(0.0, wall - sum(seconds.values()))
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:15]
    return {"profiled_step_s": round(wall, 4),
            "categories_s": {k: round(seconds.get(k, 0.0), 4) for k in CATEGORIES},
            "categories_share": {k: round(seconds.get(k, 0.0) / wall, 3) for k in CATEGORIES},
            "host_reads_per_step": syncs / steps,
            "top_operators_s": {k: round(v / steps, 4) for k, v in top}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--megamoe-flags", default="")
    p.add_argument("--json", action="store_true", help="(the output is always JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    side = MegamoeSide(SHAPE, args.megamoe_flags)
    time_steps(side, args.warmup)
    unprofiled = min(time_steps(side, args.steps))  # the profiler's own cost, for reference
    instrument(side)
    time_steps(side, 1)
    result = {"shape": SHAPE, "megamoe_flags": args.megamoe_flags, "threads": args.threads,
              "unprofiled_step_s": round(unprofiled, 4), **profile(side, args.steps)}
    rate = gemm_rate(SHAPE["batch"] * SHAPE["seq"], SHAPE["hidden"], SHAPE["ffn"])
    flops = step_gemm_flops(side)
    opt_s = optimizer_seconds(side)
    result["floor"] = {"step_gemm_gflop": round(flops / 1e9, 3),
                       "gemm_gflops_per_s": round(rate / 1e9, 2),
                       "gemm_s": round(flops / rate, 4), "optimizer_s": round(opt_s, 4),
                       "floor_s": round(flops / rate + opt_s, 4)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
