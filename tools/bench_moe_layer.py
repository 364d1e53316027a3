"""Micro benchmark: forward+backward of one MoE layer, grouped GEMM vs loop vs one-hot.

Baselines, all in one run on the same weights and input:
  grouped  MoELayer with --moe-grouped-gemm (sort-based dispatch, one grouped GEMM per fc)
  loop     MoELayer with per-expert matmuls (Megatron SequentialMLP)
  onehot   GShard-style einsum dispatch/combine through a [T, E, C] one-hot tensor with
           capacity C = capacity_factor * T * k / E (drops overflow; O(T*E*C) memory)

Usage: python tools/bench_moe_layer.py --json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe.config import MoEConfig  # noqa: E402
from megamoe.moe.grouped_gemm import resolve_backend  # noqa: E402
from megamoe.moe.layer import MoELayer  # noqa: E402
from megamoe.moe.router import topk_routing  # noqa: E402


def onehot_moe(layer: MoELayer, x_TH: torch.Tensor, capacity_factor: float) -> torch.Tensor:
    """GShard einsum MoE with the layer's weights (the baseline sort-based dispatch replaces)."""
    cfg = layer.config
    T, E = x_TH.shape[0], cfg.num_experts
    capacity = math.ceil(capacity_factor * T * cfg.topk / E)
    probs_TE, map_TE = topk_routing(layer.router.gating(x_TH), cfg.topk)
    position_TE = (map_TE.long().cumsum(0) - 1) * map_TE  # slot of each token in its expert
    keep_TE = map_TE & (position_TE < capacity)
    slot_TEC = F.one_hot(position_TE.clamp(max=capacity - 1), capacity).to(x_TH.dtype)
    dispatch_TEC = slot_TEC * keep_TE.unsqueeze(-1)
    combine_TEC = dispatch_TEC * probs_TE.to(x_TH.dtype).unsqueeze(-1)
    ex = layer.experts
    x_ECH = torch.einsum("tec,th->ech", dispatch_TEC, x_TH)
    h_ECF = torch.einsum("ech,ehf->ecf", x_ECH, ex.fc1_weight)
    y_ECH = torch.einsum("ecf,efh->ech", ex.activation(h_ECF), ex.fc2_weight)
    return torch.einsum("tec,ech->th", combine_TEC, y_ECH)


def time_fwd_bwd(fn, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of forward + backward after one warm-up run."""
    times = []
    for i in range(repeats + 1):
        xi = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        fn(xi).float().square().mean().backward()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()

    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=args.experts, topk=args.topk, ffn_hidden_size=args.ffn,
                    grouped_gemm=True)
    layer = MoELayer(cfg, args.hidden, layer_number=0, num_layers=1, init_method_std=0.02,
                     add_bias_linear=False, swiglu=True).to(dtype)
    x = torch.randn(args.tokens, args.hidden).to(dtype)

    def run(grouped: bool):
        def fn(xi):
            layer.experts.backend = "auto" if grouped else "loop"
            return layer(xi)
        return fn

    t_grouped = time_fwd_bwd(run(True), x, args.repeats)
    t_loop = time_fwd_bwd(run(False), x, args.repeats)
    t_onehot = time_fwd_bwd(lambda xi: onehot_moe(layer, xi, args.capacity_factor), x,
                            args.repeats)
    flops = 3 * 2 * args.tokens * args.topk * 3 * args.hidden * args.ffn  # fwd + 2x bwd
    out = {
        "shape": {"T": args.tokens, "H": args.hidden, "F": args.ffn, "E": args.experts,
                  "k": args.topk, "dtype": args.dtype, "swiglu": True},
        "grouped_backend": resolve_backend(x, layer.experts.fc1_weight, "auto"),
        "threads": torch.get_num_threads(),
        "grouped_ms": round(1e3 * t_grouped, 2),
        "loop_ms": round(1e3 * t_loop, 2),
        "onehot_einsum_ms": round(1e3 * t_onehot, 2),
        "onehot_capacity_factor": args.capacity_factor,
        "loop_over_grouped": round(t_loop / t_grouped, 3),
        "onehot_over_grouped": round(t_onehot / t_grouped, 3),
        "grouped_expert_gflops": round(flops / t_grouped / 1e9, 1),
    }
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
