"""Benchmark: adaptive expert parallelism — one MoE layer's forward+backward on N gloo ranks
(CPU) in each fixed mode ("ep" all-to-all tokens, "dp" gathered weights, "tp" re-sliced
weights + gathered tokens) and in the mode the cost model picks ("auto"), over a sweep of
tokens per rank. Same weights and tokens for every mode (outputs checked against "ep");
one thread per rank, fp32; an iteration's time is the slowest rank's, the reported number
the fastest of --repeats rounds after one warm-up (the modes take turns within a round; the
minimum, as timeit recommends, is what a shared machine disturbs least). The cost model's
link timings are measured once at start-up, as pretrain_gpt.py --moe-adaptive-parallelism
does. The default sweep covers two expert shapes: wide experts (weights outweigh the tokens
until thousands of tokens per rank) and thin ones (tokens outweigh the weights early).

Usage: python tools/bench_adaptive.py --json [--world-size 4] [--tokens 16,64,256,1024,4096]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe.config import MoEConfig, MoEExecutionConfig  # noqa: E402
from megamoe.moe.cost_model import CollectiveCosts, predict_mode_seconds  # noqa: E402
from megamoe.moe.dispatchers import PARALLEL_MODES  # noqa: E402
from megamoe.moe.layer import MoELayer  # noqa: E402
from megamoe.parallelize import enable_adaptive_parallelism, parallelize_moe  # noqa: E402
from tools.gloo_ranks import run_gloo_ranks  # noqa: E402

CPU = torch.device("cpu")  # gloo ranks on the host: the mesh device here


def _time_modes(layer: MoELayer, x: torch.Tensor, repeats: int
                ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Fastest ms per mode; the modes take turns within each round (starting with a
    different one each round), so a slow spell of a shared machine hits all alike. "auto"
    calibrates at its first call, in the warm-up round."""
    modes = (*PARALLEL_MODES, "auto")
    times: dict[str, list[float]] = {m: [] for m in modes}
    outs = {}
    for i in range(repeats + 1):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:  # rotating order
            dist.barrier()
            start = time.perf_counter()
            xi = x.clone().requires_grad_()
            out = layer(xi, parallel_mode=None if mode == "auto" else mode)
            out.square().mean().backward()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:  # the first round warms up
                times[mode].append(float(elapsed))
            outs[mode] = out.detach()
    return {m: 1000 * min(t) for m, t in times.items()}, outs


def _bench_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Rows of the sweep, identical on every rank; run by gloo_ranks.run_gloo_ranks."""
    costs = CollectiveCosts.measure(dist.group.WORLD, CPU)
    rows = []
    for ffn, tokens in itertools.product(args.ffn_hidden_sizes, args.tokens):
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(num_experts=args.num_experts, topk=args.topk,
                                   ffn_hidden_size=ffn),
                         args.hidden_size, init_method_std=0.02, grouped_gemm=True)
        parallelize_moe(layer, ep_group=dist.group.WORLD,
                        execution=MoEExecutionConfig(token_dispatcher_type="alltoall",
                                                     grouped_gemm=True))
        (executor,) = enable_adaptive_parallelism(layer, dist.group.WORLD, device=CPU,
                                                  measure=False)
        executor.costs, executor.calibrate = costs, True  # as measure=True, costs shared
        x = torch.randn(tokens, args.hidden_size,
                        generator=torch.Generator().manual_seed(1 + rank))
        ms, outs = _time_modes(layer, x, args.repeats)
        shape = (layer.experts, tokens, args.hidden_size, args.num_experts)
        auto_mode = executor.choose(*shape)
        diff = torch.tensor([max(float((outs[m] - outs["ep"]).abs().max())
                                 for m in PARALLEL_MODES)])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        predicted = predict_mode_seconds(executor.costs, executor.cost_inputs(*shape))
        fixed = {m: ms[m] for m in PARALLEL_MODES}
        best, worst = min(fixed, key=fixed.get), max(fixed, key=fixed.get)
        rows.append({
            "ffn_hidden_size": ffn, "tokens_per_rank": tokens,
            "ms": {k: round(v, 2) for k, v in ms.items()},
            "predicted_ms": {k: round(1000 * v, 2) for k, v in predicted.items()},
            "calibration_ms": {k: round(1000 * v, 2)
                               for k, v in executor.timings.get(tokens, {}).items()},
            "auto_mode": auto_mode, "best_fixed_mode": best,
            "auto_over_best": round(ms["auto"] / fixed[best], 3),
            "chosen_over_best": round(fixed[auto_mode] / fixed[best], 3),
            "auto_over_worst": round(ms["auto"] / fixed[worst], 3),
            "max_abs_diff_vs_ep": float(diff)})
    return {"rows": rows, "link_costs": costs.as_dict()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-sizes", default="512,64",
                   help="comma-separated expert hidden sizes (one sweep each)")
    p.add_argument("--tokens", default="16,256,2048,8192",
                   help="comma-separated tokens per rank")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    for flag in ("tokens", "ffn_hidden_sizes"):
        try:
            setattr(args, flag, [int(t) for t in getattr(args, flag).split(",")])
        except ValueError:
            p.error(f"--{flag.replace('_', '-')}: expected comma-separated integers, got "
                    f"{getattr(args, flag)!r}")
    if args.num_experts % args.world_size:
        p.error(f"--num-experts ({args.num_experts}) must be divisible by --world-size "
                f"({args.world_size})")
    result = run_gloo_ranks(_bench_rank, args.world_size, args, args.timeout,
                            "bench_adaptive.py")
    rows = result["rows"]
    summary = {"auto_never_slower_than_worst": all(r["auto_over_worst"] <= 1.0 for r in rows),
               "auto_within_10pct_of_best": all(r["auto_over_best"] <= 1.1 for r in rows),
               "chosen_mode_within_10pct_of_best": all(r["chosen_over_best"] <= 1.1
                                                       for r in rows)}
    shape = {k: getattr(args, k) for k in ("world_size", "num_experts", "topk", "hidden_size",
                                          "ffn_hidden_sizes")}
    if args.json:
        print(json.dumps({"shape": shape, "dtype": "fp32", "backend": "gloo", **result,
                          "summary": summary}))
        return
    print(f"MoE layer fwd+bwd, EP={args.world_size} gloo ranks, {shape}")
    for r in rows:
        times = "  ".join(f"{k} {v:8.2f}" for k, v in r["ms"].items())
        print(f"  F={r['ffn_hidden_size']:5d} {r['tokens_per_rank']:6d} tokens/rank: {times} ms"
              f" -> auto={r['auto_mode']} ({r['auto_over_best']:.2f}x best)")
    print(summary)


if __name__ == "__main__":
    main()
