#!/usr/bin/env python
"""Benchmark: activation bytes a transformer layer keeps for backward, per recompute mode,
measured against the memory model (megamoe/planning/activations.py).

For each shape, a decoder of --layers layers (MoE layers, SwiGLU experts, RoPE, RMSNorm,
GQA; dropout off; fp32 unless --dtype bf16) is built single-process, each recompute mode is
applied with the parallelize step's `apply_recompute`, and one training forward of the
layers runs on an input made beforehand; `tools/memory_tracking.py` counts the bytes the
forward allocated and still holds once it returns (what backward will read), minus the
output, plus the input (the first layer keeps it too). Per layer = that / layers.
Modes: none; selective with each module alone (core_attn, layernorm, moe_act, moe,
and, on variants of the shape that have them, mlp on dense layers and shared_experts on a
shared expert of the experts' size); full (uniform, 1 layer per group).

Shapes: those of tools/bench_moe_layer.py (mixtral: E=8, k=2, H=1024, F=2048;
fine_grained: E=64, k=8, H=1024, F=256; S=4096 tokens, 8 heads of 128, 2 KV groups) and
tiny (a smoke test). Prints one JSON object: per shape and mode, measured and modelled
bytes per layer and their ratio; exits 1 with --max-error E when a ratio is off by more
than E (0.25: within 25%).

    python tools/bench_activation_memory.py --json [--shapes tiny] [--max-error 0.25]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe.config import ModelConfig, MoEConfig, RecomputeConfig  # noqa: E402
from megamoe.model.gpt_model import GPTModel, rotary_for  # noqa: E402
from megamoe.model.transformer_block import run_layers  # noqa: E402
from megamoe.parallelize import apply_recompute  # noqa: E402
from megamoe.planning.activations import layer_activation_bytes  # noqa: E402
from tools.memory_tracking import TensorMemoryTracker  # noqa: E402

SHAPES = {
    "mixtral": dict(E=8, k=2, H=1024, F=2048, S=4096, heads=8, groups=2),
    "fine_grained": dict(E=64, k=8, H=1024, F=256, S=4096, heads=8, groups=2),
    "tiny": dict(E=4, k=2, H=64, F=96, S=64, heads=4, groups=2),
}
SELECTIVE = ("core_attn", "layernorm", "moe_act", "moe", "mlp", "shared_experts")


def model_config(shape: dict, layers: int, *, dense: bool = False,
                 shared: bool = False) -> ModelConfig:
    """The decoder of `shape`: MoE layers, or (`dense`) dense MLPs of the same FLOPs (k x F
    wide); `shared` adds a shared expert as wide as one routed expert."""
    moe = MoEConfig(num_experts=shape["E"], topk=shape["k"], ffn_hidden_size=shape["F"],
                    shared_expert_intermediate_size=shape["F"] if shared else None)
    return ModelConfig(
        num_layers=layers, hidden_size=shape["H"], ffn_hidden_size=shape["k"] * shape["F"],
        num_attention_heads=shape["heads"], num_query_groups=shape["groups"],
        seq_length=shape["S"], max_position_embeddings=shape["S"], vocab_size=128,
        normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        moe=None if dense else moe)


def recompute_for(mode: str) -> RecomputeConfig:
    if mode == "none":
        return RecomputeConfig()
    if mode == "full":
        return RecomputeConfig(granularity="full", method="uniform", num_layers=1)
    return RecomputeConfig(granularity="selective", modules=[mode])


def measure(config: ModelConfig, mode: str, dtype: torch.dtype,
            grouped_gemm: bool = True) -> float:
    """Bytes per layer one training forward keeps for backward under `mode`."""
    torch.manual_seed(0)
    model = GPTModel(config).to(dtype)
    for m in model.modules():  # the grouped GEMM, as --moe-grouped-gemm (moe_act needs it)
        if hasattr(m, "backend"):
            m.backend = "auto" if grouped_gemm else "loop"
    apply_recompute(model, recompute_for(mode))
    model.train()
    s, h = config.seq_length, config.hidden_size
    x_SBH = torch.randn(s, 1, h, dtype=dtype, requires_grad=True)
    rotary = rotary_for(config, torch.zeros(1, s, dtype=torch.long), None)
    block = model.decoder
    with TensorMemoryTracker() as tracker:
        out = run_layers(block.layers, x_SBH, rotary, block.recompute_groups)
        kept = tracker.live - out.untyped_storage().nbytes() + x_SBH.untyped_storage().nbytes()
    out.float().sum().backward()  # (the replay must work; its memory is not counted)
    return kept / config.num_layers


def modelled(config: ModelConfig, mode: str, act_bytes: int) -> float:
    """The memory model's bytes per layer for `mode` (mean over the decoder's layers)."""
    per = [layer_activation_bytes(config, i, recompute_for(mode), tokens=config.seq_length,
                                  act_bytes=act_bytes) for i in range(config.num_layers)]
    return sum(per) / len(per)


def run_shape(name: str, layers: int, dtype: torch.dtype, modes: list[str]) -> dict:
    shape = SHAPES[name]
    act_bytes = torch.empty((), dtype=dtype).element_size()
    out = {}
    for mode in modes:
        kind = {"mlp": dict(dense=True), "shared_experts": dict(shared=True)}.get(mode, {})
        config = model_config(shape, layers, **kind)
        start = time.perf_counter()
        got = measure(config, mode, dtype)
        want = modelled(config, mode, act_bytes)
        base = measure(config, "none", dtype) if kind else None
        out[mode] = {"measured_bytes_per_layer": int(got), "modelled_bytes_per_layer": int(want),
                     "measured_over_modelled": round(got / want, 4) if want else None,
                     "seconds": round(time.perf_counter() - start, 2)}
        if base is not None:  # the variant's own baseline (dense layers / shared expert)
            out[mode]["measured_bytes_per_layer_without_recompute"] = int(base)
    return {"shape": dataclasses.asdict(model_config(shape, layers)) | {"tokens": shape["S"]},
            "modes": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["mixtral", "fine_grained"],
                   choices=sorted(SHAPES))
    p.add_argument("--modes", nargs="+", default=["none", *SELECTIVE, "full"],
                   choices=["none", *SELECTIVE, "full"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-error", type=float, default=None)
    p.add_argument("--json", action="store_true", help="(the output is always JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    result = {"dtype": args.dtype, "layers": args.layers,
              "shapes": {s: run_shape(s, args.layers, dtype, args.modes) for s in args.shapes}}
    print(json.dumps(result, indent=2))
    if args.max_error is not None:
        bad = [(s, m) for s, r in result["shapes"].items() for m, v in r["modes"].items()
               if v["measured_over_modelled"] is not None
               and abs(v["measured_over_modelled"] - 1) > args.max_error]
        if bad:
            print(f"off by more than {args.max_error:.0%}: {bad}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
