"""Benchmark: one expert-parallel MoE layer, forward+backward, on N gloo ranks (CPU).

Every configuration runs on the same weights and tokens: the allgather dispatcher, the
alltoall dispatcher, and the alltoall dispatcher with --moe-a2a-overlap-degree 2 (token
chunks whose all-to-alls run asynchronously while the experts compute). EP = world size,
one thread per rank, fp32; the time of an iteration is the slowest rank's, the reported
number the median over --repeats after one warm-up. Configurations take turns, one
iteration each, so a load change on a shared machine hits them all alike. Each
configuration's output and input gradient are checked against the first one (max relative
difference reported), so a fast wrong path shows.

Peer: DeepSpeed-MoE's layer (`deepspeed.moe.layer.MoE`) then runs in the same ranks on the
same router and expert weights and tokens, timed the same way; its row under "peers" gives
its time over each of ours and what it does differently. It is a benchmark-only dependency
(scripts/install_bench_peers.sh); without it the row says "skipped" and the run succeeds.

Usage: python tools/bench_dispatch.py --json [--world-size 4] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe.config import MoEConfig, MoEExecutionConfig  # noqa: E402
from megamoe.moe.layer import MoELayer  # noqa: E402
from megamoe.parallelize import parallelize_moe  # noqa: E402
from tools.gloo_ranks import run_gloo_ranks  # noqa: E402

CONFIGS = (("allgather", 1), ("alltoall", 1), ("alltoall", 2))
DEEPSPEED_LAYER = "deepspeed.moe.layer.MoE"
DEEPSPEED_MISSING = "deepspeed not installed (scripts/install_bench_peers.sh)"


def _time_fwd_bwd(layer: Callable[[torch.Tensor], torch.Tensor],
                  x_TH: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Seconds (slowest rank) of one forward + backward of mean(out^2); output, input grad."""
    dist.barrier()
    start = time.perf_counter()
    xi = x_TH.clone().requires_grad_()
    out = layer(xi)
    out.square().mean().backward()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), out.detach(), xi.grad


def _time_round_robin(layers: list[Callable[[torch.Tensor], torch.Tensor]], x_TH: torch.Tensor,
                      repeats: int) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
    """Per layer: median ms over `repeats` after one warm-up, last output and input grad.
    Iteration i of every layer runs before iteration i + 1 of any."""
    times: list[list[float]] = [[] for _ in layers]
    last: list = [None] * len(layers)
    for i in range(repeats + 1):
        for j, layer in enumerate(layers):
            seconds, out, grad = _time_fwd_bwd(layer, x_TH)
            if i:  # the first iteration warms up
                times[j].append(seconds)
            last[j] = (out, grad)
    return [(round(1000 * statistics.median(t), 2), out, grad)
            for t, (out, grad) in zip(times, last)]


def _max_rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|, maximised over ranks."""
    diff = torch.tensor([float((a - ref).abs().max() / ref.abs().max().clamp(min=1e-30))])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def _config_key(dispatcher: str, overlap: int) -> str:
    return dispatcher if overlap == 1 else f"{dispatcher}_overlap{overlap}"


# ---------------------------------------------------------------- DeepSpeed-MoE peer


class _PeerExpert(nn.Module):
    """One expert as DeepSpeed expects it (a dense module on [..., H]): our expert MLP
    (SwiGLU or GELU, no bias) with weights copied from a GroupedExperts slice."""

    def __init__(self, fc1_HF: torch.Tensor, fc2_FH: torch.Tensor, swiglu: bool) -> None:
        super().__init__()
        self.swiglu = swiglu
        self.fc1 = nn.Linear(fc1_HF.shape[0], fc1_HF.shape[1], bias=False)
        self.fc2 = nn.Linear(fc2_FH.shape[0], fc2_FH.shape[1], bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(fc1_HF.t())
            self.fc2.weight.copy_(fc2_FH.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(h))


def _import_deepspeed():
    """(deepspeed module, None) or (None, why not), agreed by every rank."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    module, reason = None, None
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON
            import deepspeed
            import deepspeed.ops
            from deepspeed.moe.layer import MoE  # noqa: F401
        module = deepspeed
    except ModuleNotFoundError as err:
        reason = (DEEPSPEED_MISSING if err.name == "deepspeed"
                  else f"deepspeed not importable: {err} (scripts/install_bench_peers.sh)")
    except Exception as err:  # a broken install must not break our own rows
        reason = f"deepspeed not importable: {err!r} (scripts/install_bench_peers.sh)"
    ok = torch.tensor([0 if module is None else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if module is not None and not int(ok):
        module, reason = None, "deepspeed not importable on every rank"
    return module, reason


def _deepspeed_settings(topk: int) -> dict:
    """DeepSpeed MoE arguments that make its work the same as ours: nothing dropped,
    deterministic top-k (its defaults drop tokens and sample the 2nd expert)."""
    return {"k": topk, "drop_tokens": False, "top2_2nd_expert_sampling": False,
            "use_rts": False, "noisy_gate_policy": None, "use_residual": False,
            "use_tutel": False}


def _deepspeed_differences(topk: int) -> list[str]:
    notes = [
        "capacity: DeepSpeed pads every expert's input to one capacity C. Its default "
        "(drop_tokens=True, capacity_factor=1.0) drops tokens past C = k*T/E per expert; "
        "here drop_tokens=False, so C = the largest per-expert token count on any rank "
        "(all-reduced over ep each forward), nothing is dropped, and each rank's experts "
        "compute E*C rows (padding included) where ours compute exactly the routed ones",
        "routing: top2_2nd_expert_sampling=False (its default picks the 2nd expert with "
        "Gumbel noise); gates renormalised over the chosen k, which equals our softmax over "
        "the top-k logits; same router and expert weights as ours, so max_rel_diff_vs_first "
        "checks it computes the same function",
        "dispatch: dense [E, C, H] buffers exchanged by one equal-split all_to_all each way "
        "(ours: exact uneven splits)",
        "experts: one nn.Linear MLP per local expert in a Python loop (DeepSpeed's Experts); "
        "ours: one grouped GEMM per projection",
        "comm: its CPU shared-memory all-reduce kernel (a JIT C++ build that only "
        "inference_all_reduce uses) is switched off, so every collective goes through the "
        "same torch.distributed gloo group as ours",
        "aux loss: DeepSpeed computes its l_aux every forward (returned, unused here); ours "
        "computes none at the default --moe-aux-loss-coeff 0",
    ]
    if topk == 1:
        notes.append("k=1: DeepSpeed weights the expert output by its softmax probability, "
                     "ours by 1.0 (softmax over the one top logit), so outputs differ")
    return notes


def _build_deepspeed(base: MoELayer, args: argparse.Namespace) -> tuple[Optional[nn.Module],
                                                                         dict]:
    """deepspeed.moe.layer.MoE with `base`'s router and expert weights on the world group,
    and the start of its row; (None, row saying why) when it cannot run."""
    row: dict = {"name": DEEPSPEED_LAYER}
    if args.no_deepspeed:
        return None, {**row, "skipped": "--no-deepspeed"}
    deepspeed, reason = _import_deepspeed()
    if deepspeed is None:
        return None, {**row, "skipped": reason}
    torch.set_num_threads(1)  # as for our rows, whatever the import did
    world, rank = dist.get_world_size(), dist.get_rank()
    num_local = args.num_experts // world
    settings = _deepspeed_settings(args.topk)
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.moe.layer import MoE
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo")
        experts = base.experts
        template = _PeerExpert(experts.fc1_weight[0], experts.fc2_weight[0], experts.swiglu)
        layer = MoE(args.hidden_size, template, num_experts=args.num_experts, ep_size=world,
                    **settings)
        layer.set_deepspeed_parallelism()
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(base.router.weight)
        for j, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            e = rank * num_local + j  # the ep all-to-all hands rank r experts r*L .. r*L+L-1
            expert.fc1.weight.copy_(experts.fc1_weight[e].t())
            expert.fc2.weight.copy_(experts.fc2_weight[e].t())
    return layer, {**row, "version": deepspeed.__version__, "settings": settings}


def _deepspeed_row(layer: nn.Module, row: dict, timed: tuple, reference: tuple, ours: dict,
                   args: argparse.Namespace) -> dict:
    """The peer's measured row: time over each of ours, agreement with ours, padding."""
    ms, out, grad = timed
    capacity = layer.deepspeed_moe.exp_counts.max().reshape(1).to(torch.int64)
    dist.all_reduce(capacity, op=dist.ReduceOp.MAX)
    return {**row, "ms": ms, "ms_over_ours": {k: round(ms / v, 3) for k, v in ours.items()},
            "max_rel_diff_vs_first": _max_rel_diff(out, reference[0]),
            "max_rel_diff_grad_vs_first": _max_rel_diff(grad, reference[1]),
            "capacity_per_expert": int(capacity),
            "expert_rows_per_rank": args.num_experts * int(capacity),
            "routed_rows_per_rank": args.topk * args.tokens,
            "differences": _deepspeed_differences(args.topk)}


# ---------------------------------------------------------------- ranks and driver


def _bench_rank(rank: int, world: int, args: argparse.Namespace) -> tuple[list, list]:
    """(our rows, peer rows), identical on every rank; run by gloo_ranks.run_gloo_ranks."""
    torch.manual_seed(0)
    base = MoELayer(MoEConfig(num_experts=args.num_experts, topk=args.topk,
                              ffn_hidden_size=args.ffn_hidden_size),
                    args.hidden_size, init_method_std=0.02, grouped_gemm=True)
    x = torch.randn(args.tokens, args.hidden_size,
                    generator=torch.Generator().manual_seed(1 + rank))
    layers: list = []
    for dispatcher, overlap in CONFIGS:
        layer = copy.deepcopy(base)
        execution = MoEExecutionConfig(token_dispatcher_type=dispatcher,
                                       a2a_overlap_degree=overlap, grouped_gemm=True)
        layers.append(parallelize_moe(layer, ep_group=dist.group.WORLD, execution=execution))
    peer, peer_row = _build_deepspeed(base, args)
    if peer is not None:
        layers.append(lambda xi: peer(xi)[0])  # MoE returns (out, l_aux, exp_counts)
    timed = _time_round_robin(layers, x, args.repeats)
    reference = timed[0][1:]
    results = [{"dispatcher": dispatcher, "overlap_degree": overlap, "ms": ms,
                "max_rel_diff_vs_first": _max_rel_diff(out, reference[0]),
                "max_rel_diff_grad_vs_first": _max_rel_diff(grad, reference[1])}
               for (dispatcher, overlap), (ms, out, grad) in zip(CONFIGS, timed)]
    ours = {_config_key(r["dispatcher"], r["overlap_degree"]): r["ms"] for r in results}
    if peer is not None:
        peer_row = _deepspeed_row(peer, peer_row, timed[-1], reference, ours, args)
    return results, [peer_row]


def _print_text(shape: dict, results: list[dict], peers: list[dict]) -> None:
    print(f"MoE layer fwd+bwd, EP={shape['world_size']} gloo ranks, {shape}")
    for r in results:
        print(f"  {r['dispatcher']:9s} overlap {r['overlap_degree']}: {r['ms']:9.2f} ms "
              f"(max rel diff {r['max_rel_diff_vs_first']:.1e})")
    for p in peers:
        if "skipped" in p:
            print(f"  {p['name']}: skipped ({p['skipped']})")
            continue
        ratios = ", ".join(f"{v:.2f}x {k}" for k, v in p["ms_over_ours"].items())
        print(f"  {p['name']} {p['version']}: {p['ms']:9.2f} ms (max rel diff "
              f"{p['max_rel_diff_vs_first']:.1e}; {ratios}; capacity "
              f"{p['capacity_per_expert']}, {p['expert_rows_per_rank']} expert rows for "
              f"{p['routed_rows_per_rank']} routed)")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--ffn-hidden-size", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-deepspeed", action="store_true",
                   help="do not run the DeepSpeed-MoE peer even when it is installed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.num_experts % args.world_size:
        p.error(f"--num-experts ({args.num_experts}) must be divisible by --world-size "
                f"({args.world_size})")
    results, peers = run_gloo_ranks(_bench_rank, args.world_size, args, args.timeout,
                                    "bench_dispatch.py")
    shape = {k: getattr(args, k) for k in ("world_size", "num_experts", "topk", "hidden_size",
                                          "ffn_hidden_size", "tokens")}
    if args.json:
        timing = {"repeats": args.repeats, "warmup": 1, "statistic": "median of the slowest "
                  "rank", "order": "round-robin over configurations and peers"}
        print(json.dumps({"shape": shape, "dtype": "fp32", "backend": "gloo",
                          "timing": timing, "results": results, "peers": peers}))
        return
    _print_text(shape, results, peers)


if __name__ == "__main__":
    main()
