"""Benchmark: one expert-parallel MoE layer, forward+backward, on N gloo ranks (CPU).

Every configuration runs on the same weights and tokens: the allgather dispatcher, the
alltoall dispatcher, and the alltoall dispatcher with --moe-a2a-overlap-degree 2 (token
chunks whose all-to-alls run asynchronously while the experts compute). EP = world size,
one thread per rank, fp32; the time of an iteration is the slowest rank's, the reported
number the median over --repeats after one warm-up. Each configuration's output is checked
against the first one (max relative difference reported), so a fast wrong path shows.

Usage: python tools/bench_dispatch.py --json [--world-size 4] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe.config import MoEConfig  # noqa: E402
from megamoe.moe.dispatcher import apply_expert_parallel  # noqa: E402
from megamoe.moe.layer import MoELayer  # noqa: E402

CONFIGS = (("allgather", 1), ("alltoall", 1), ("alltoall", 2))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        torch.manual_seed(0)
        base = MoELayer(MoEConfig(num_experts=args.num_experts, topk=args.topk,
                                  ffn_hidden_size=args.ffn_hidden_size, grouped_gemm=True),
                        args.hidden_size, init_method_std=0.02)
        x = torch.randn(args.tokens, args.hidden_size,
                        generator=torch.Generator().manual_seed(1 + rank))
        results, reference = [], None
        for dispatcher, overlap in CONFIGS:
            layer = copy.deepcopy(base)
            layer.config.token_dispatcher_type = dispatcher
            layer.config.a2a_overlap_degree = overlap
            apply_expert_parallel(layer, dist.group.WORLD, dispatcher)
            times = []
            for i in range(args.repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                xi = x.clone().requires_grad_()
                out = layer(xi)
                out.square().mean().backward()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i:  # the first iteration warms up
                    times.append(float(elapsed))
            out = out.detach()
            if reference is None:
                reference = out
            diff = torch.tensor([float((out - reference).abs().max()
                                       / reference.abs().max().clamp(min=1e-30))])
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            results.append({"dispatcher": dispatcher, "overlap_degree": overlap,
                            "ms": round(1000 * statistics.median(times), 2),
                            "max_rel_diff_vs_first": float(diff)})
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--ffn-hidden-size", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.num_experts % args.world_size:
        p.error(f"--num-experts ({args.num_experts}) must be divisible by --world-size "
                f"({args.world_size})")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_bench_rank, args=(r, args.world_size, port, args, queue))
             for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    try:
        results = queue.get(timeout=args.timeout)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    failed = [proc.exitcode for proc in procs if proc.exitcode]
    if failed:
        sys.exit(f"bench_dispatch.py: a rank failed (exit codes {failed})")
    shape = {k: getattr(args, k) for k in ("world_size", "num_experts", "topk", "hidden_size",
                                          "ffn_hidden_size", "tokens")}
    if args.json:
        print(json.dumps({"shape": shape, "dtype": "fp32", "backend": "gloo",
                          "results": results}))
        return
    print(f"MoE layer fwd+bwd, EP={args.world_size} gloo ranks, {shape}")
    for r in results:
        print(f"  {r['dispatcher']:9s} overlap {r['overlap_degree']}: {r['ms']:9.2f} ms "
              f"(max rel diff {r['max_rel_diff_vs_first']:.1e})")


if __name__ == "__main__":
    main()
