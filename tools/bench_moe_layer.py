"""Benchmark: forward+backward of one MoE layer against the naive ways and dense GEMMs.

In one process and one run, on the same weights and input (SwiGLU experts, fp32 by default,
2 threads, one warm-up then the median of --repeats):
  moe     megamoe.MoELayer: sort-based dropless dispatch + one grouped GEMM per projection
  loop    per-expert loop as transformers' MixtralSparseMoeBlock (one_hot mask, where,
          index_add)
  einsum  GShard/fairseq: one-hot [T, E, C] dispatch/combine einsums, capacity factor 1.0
  dense   a dense SwiGLU MLP with intermediate k x F: the same expert FLOPs as one GEMM
          each, this machine's ceiling
  experts_gemm  the moe layer's two grouped GEMMs alone (forward and backward, its group
          sizes): dense_ms / experts_gemm_ms bounds ratio_vs_dense from above, and
          moe_ms - experts_gemm_ms is what the layer spends outside its GEMMs
Peak activation memory = bytes saved for backward during the forward (unique storages),
the memory a training step holds per layer; reported relative to dense, with the saved
tensors of >= 1 MiB listed per variant (`saved_tensors`: [MiB, shape, dtype]).

Shapes: mixtral (E=8, k=2, H=1024, F=2048, S=4096), fine_grained (E=64, k=8, H=1024,
F=256, S=4096), tiny (smoke test). Usage: python tools/bench_moe_layer.py --json
[--device cuda --dtypes bf16] (on a GPU every timing synchronises the device first and last).
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
from megamoe.moe.grouped_gemm import grouped_mm, resolve_backend  # noqa: E402
from megamoe.moe.layer import MoELayer  # noqa: E402
from megamoe.moe.router import topk_routing  # noqa: E402

SHAPES = {
    "mixtral": dict(E=8, k=2, H=1024, F=2048, T=4096),
    "fine_grained": dict(E=64, k=8, H=1024, F=256, T=4096),
    "tiny": dict(E=4, k=2, H=64, F=128, T=256),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def loop_moe(layer: MoELayer, x_TH: torch.Tensor) -> torch.Tensor:
    """transformers' MixtralSparseMoeBlock: for each expert, where() its tokens, run, add."""
    cfg, ex = layer.config, layer.experts
    probs_TE, map_TE = topk_routing(layer.router.gating(x_TH), cfg.topk)
    out_TH = torch.zeros_like(x_TH)
    for e in range(cfg.num_experts):
        (token_idx,) = torch.where(map_TE[:, e])
        if token_idx.numel() == 0:
            continue
        h = ex.activation(x_TH[token_idx] @ ex.fc1_weight[e]) @ ex.fc2_weight[e]
        out_TH = out_TH.index_add(0, token_idx, h * probs_TE[token_idx, e, None].to(h.dtype))
    return out_TH


def einsum_moe(layer: MoELayer, x_TH: torch.Tensor, capacity_factor: float = 1.0
               ) -> torch.Tensor:
    """GShard einsum MoE: one-hot [T, E, C] dispatch and combine tensors (drops overflow)."""
    cfg, ex = layer.config, layer.experts
    T, E = x_TH.shape[0], cfg.num_experts
    capacity = math.ceil(capacity_factor * T * cfg.topk / E)
    probs_TE, map_TE = topk_routing(layer.router.gating(x_TH), cfg.topk)
    position_TE = (map_TE.long().cumsum(0) - 1) * map_TE  # slot of each token in its expert
    keep_TE = map_TE & (position_TE < capacity)
    slot_TEC = F.one_hot(position_TE.clamp(max=capacity - 1), capacity).to(x_TH.dtype)
    dispatch_TEC = slot_TEC * keep_TE.unsqueeze(-1)
    combine_TEC = dispatch_TEC * probs_TE.to(x_TH.dtype).unsqueeze(-1)
    x_ECH = torch.einsum("tec,th->ech", dispatch_TEC, x_TH)
    h_ECF = torch.einsum("ech,ehf->ecf", x_ECH, ex.fc1_weight)
    y_ECH = torch.einsum("ecf,efh->ech", ex.activation(h_ECF), ex.fc2_weight)
    return torch.einsum("tec,ech->th", combine_TEC, y_ECH)


class DenseSwiGLU(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype,
                 device: str = "cpu") -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(
            torch.randn(hidden, 2 * ffn, device=device).to(dtype) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(ffn, hidden, device=device).to(dtype) * 0.02)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        gate, up = (x_TH @ self.w1).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w2


def saved_tensors(fn, x: torch.Tensor) -> list[tuple[int, list[int], str]]:
    """(bytes, shape, dtype) of each distinct storage autograd saves for backward in one
    forward, largest first (views of one storage count once, with the first shape seen)."""
    seen: dict[int, tuple[int, list[int], str]] = {}

    def pack(t: torch.Tensor):
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), (s.nbytes(), list(t.shape), str(t.dtype)[6:]))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x.detach().requires_grad_(True))
    del out
    return sorted(seen.values(), key=lambda v: -v[0])


def saved_activation_bytes(fn, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward."""
    return sum(nbytes for nbytes, _, _ in saved_tensors(fn, x))


def _breakdown(saved: list[tuple[int, list[int], str]], min_bytes: int = 1 << 20) -> list:
    """The saved tensors of at least min_bytes as [MiB, shape, dtype] (the memory profile)."""
    return [[round(b / 2**20, 2), shape, dt] for b, shape, dt in saved if b >= min_bytes]


def time_fwd_bwd(fn, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of forward + backward after one warm-up run."""
    times = []
    for i in range(repeats + 1):
        xi = x.detach().requires_grad_(True)
        _sync(x.device)
        t0 = time.perf_counter()
        fn(xi).float().square().mean().backward()
        _sync(x.device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_shape(name: str, dtype_name: str, repeats: int, baseline_repeats: int,
                device: str = "cpu") -> dict:
    s = SHAPES[name]
    dtype, device = DTYPES[dtype_name], torch.device(device)
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=s["E"], topk=s["k"], ffn_hidden_size=s["F"])
    layer = MoELayer(cfg, s["H"], init_method_std=0.02, swiglu=True, grouped_gemm=True)
    layer = layer.to(device=device, dtype=dtype)
    dense = DenseSwiGLU(s["H"], s["k"] * s["F"], dtype, device)
    x = torch.randn(s["T"], s["H"], device=device).to(dtype)
    fns = {"moe": layer, "loop": lambda xi: loop_moe(layer, xi),
           "einsum": lambda xi: einsum_moe(layer, xi, 1.0), "dense": dense}
    ms = {}
    for k, fn in fns.items():
        n = repeats if k in ("moe", "dense") else baseline_repeats
        ms[k] = 1e3 * time_fwd_bwd(fn, x, n)
        print(f"# {name} {dtype_name} {k}: {ms[k]:.1f} ms", file=sys.stderr, flush=True)
    # The MoE layer's expert GEMMs alone (fc1, fc2, forward and backward, the same group
    # sizes as its routing): what the layer would cost with nothing around its GEMMs.
    sizes = layer.tokens_per_expert.clone()
    x_NH = torch.randn(int(sizes.sum()), s["H"], device=device).to(dtype)
    ex = layer.experts
    ms["experts_gemm"] = 1e3 * time_fwd_bwd(
        lambda xi: grouped_mm(grouped_mm(xi, ex.fc1_weight, sizes)[:, :s["F"]],
                              ex.fc2_weight, sizes), x_NH, repeats)
    saved = {k: saved_tensors(fns[k], x) for k in ("moe", "dense", "einsum")}
    mem = {k: sum(b for b, _, _ in v) for k, v in saved.items()}
    expert_flops = 3 * 2 * s["T"] * s["k"] * 3 * s["H"] * s["F"]  # fwd + 2x bwd, 3 GEMMs
    return {
        "shape": name, "dtype": dtype_name, "device": str(device), **s,
        "threads": torch.get_num_threads(),
        "repeats": repeats, "baseline_repeats": baseline_repeats,
        "grouped_backend": resolve_backend(x, layer.experts.fc1_weight, "auto"),
        "moe_ms": round(ms["moe"], 1), "loop_ms": round(ms["loop"], 1),
        "einsum_ms": round(ms["einsum"], 1), "dense_ms": round(ms["dense"], 1),
        "ratio_vs_dense": round(ms["dense"] / ms["moe"], 3),
        "experts_gemm_ms": round(ms["experts_gemm"], 1),
        "gemm_bound_ratio_vs_dense": round(ms["dense"] / ms["experts_gemm"], 3),
        "moe_outside_gemms_ms": round(ms["moe"] - ms["experts_gemm"], 1),
        "speedup_vs_loop": round(ms["loop"] / ms["moe"], 3),
        "speedup_vs_einsum": round(ms["einsum"] / ms["moe"], 3),
        "peak_mem_ratio_vs_dense": round(mem["moe"] / mem["dense"], 3),
        "einsum_mem_ratio_vs_dense": round(mem["einsum"] / mem["dense"], 3),
        "moe_expert_gflops": round(expert_flops / ms["moe"] / 1e6, 1),
        "dense_gflops": round(expert_flops / ms["dense"] / 1e6, 1),
        "saved_mib": {k: round(mem[k] / 2**20, 1) for k in ("moe", "dense")},
        "saved_tensors": {k: _breakdown(saved[k]) for k in ("moe", "dense")},
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["mixtral", "fine_grained"],
                   choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="only the tiny shape (smoke test)")
    p.add_argument("--dtypes", nargs="+", default=["fp32"], choices=sorted(DTYPES),
                   help="bf16 matmuls are ~30x slower than fp32 on CPUs without AMX")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of moe and dense")
    p.add_argument("--baseline-repeats", type=int, default=1,
                   help="timed runs of the (slow) loop and einsum baselines")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = ["tiny"] if args.tiny else args.shapes
    results = [bench_shape(s, d, args.repeats, args.baseline_repeats, args.device)
               for s in shapes for d in args.dtypes]
    if args.json:
        print(json.dumps({"results": results}))
        return
    for r in results:
        print(" ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
