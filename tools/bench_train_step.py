#!/usr/bin/env python
"""Benchmark: one training iteration of megamoe against transformers' Mixtral, and the
step's floor, in one run.

Both sides train the same shape (defaults: hidden 256, FFN 512, 4 layers, 8 experts top-2,
8 heads / 4 KV groups, sequence 256, batch 4, vocabulary 1024, fp32, no dropout, no aux
loss, AdamW, clipping at 1.0) on the same random tokens, one process, --threads threads:
  megamoe       what pretrain_gpt.py runs per iteration (training/loop.py: train_step and
                the per-step observer), built from the same flags as the command line
  transformers  MixtralForCausalLM (SDPA attention) with a plain loop: forward with labels,
                backward, clip_grad_norm_, AdamW.step, zero_grad
Rounds alternate (megamoe, transformers, megamoe, ...); each side times its own iterations
after warm-up; per side the best of the rounds' medians is kept. The floor is the step's
GEMM FLOPs (6 x matmul weights x tokens + the causal attention's 6 x S x heads x D x
layers x tokens) at the GEMM rate measured in the same run (fp32 [tokens, H] x [H, F]
forward and backward), plus megamoe's optimizer step (clip + AdamW) timed alone.
Prints one JSON object.

    python tools/bench_train_step.py --json [--rounds 3 --iters 10] [--compile]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe.cli.arguments import parse_args  # noqa: E402
from megamoe.cli.mapping import run_config_from_args  # noqa: E402
from megamoe.model.flops import active_matmul_parameters  # noqa: E402
from megamoe.parallel.mesh import single_process_mesh  # noqa: E402
from megamoe.training.build import build_model  # noqa: E402
from megamoe.training.loop import train_step  # noqa: E402
from megamoe.training.metrics import TrainingObserver  # noqa: E402
from megamoe.training.optim import build_optimizer  # noqa: E402
from megamoe.training.schedules.lr import LRScheduler  # noqa: E402

SHAPE = dict(layers=4, hidden=256, ffn=512, experts=8, topk=2, heads=8, groups=4, seq=256,
             batch=4, vocab=1024)


def megamoe_flags(s: dict, extra: str = "") -> str:
    return (f"--num-layers {s['layers']} --hidden-size {s['hidden']} "
            f"--ffn-hidden-size {s['ffn']} --num-attention-heads {s['heads']} "
            f"--group-query-attention --num-query-groups {s['groups']} "
            f"--seq-length {s['seq']} --max-position-embeddings {s['seq']} "
            f"--normalization RMSNorm --position-embedding-type rope --swiglu "
            f"--disable-bias-linear --untie-embeddings-and-output-weights "
            f"--hidden-dropout 0 --attention-dropout 0 --num-experts {s['experts']} "
            f"--moe-router-topk {s['topk']} --moe-ffn-hidden-size {s['ffn']} "
            f"--moe-grouped-gemm --moe-router-load-balancing-type none "
            f"--mock-data --tokenizer-type NullTokenizer --vocab-size {s['vocab']} "
            f"--micro-batch-size {s['batch']} --global-batch-size {s['batch']} --lr 1e-4 "
            f"--clip-grad 1.0 --train-iters 1000 --log-interval 1000 {extra}")


def _tokens(s: dict, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1),
                         generator=torch.Generator().manual_seed(seed))


class MegamoeSide:
    """One pretrain_gpt.py iteration (train_step + the per-step observer) per call."""

    def __init__(self, s: dict, extra: str = "") -> None:
        args = parse_args(shlex.split(megamoe_flags(s, extra)), world_size=1)
        self.run = run = run_config_from_args(args, s["vocab"])
        self.mesh = single_process_mesh()
        self.model = build_model(run, self.mesh)
        self.optimizer = build_optimizer(self.model, run.optim, mesh=self.mesh)
        self.scheduler = LRScheduler(self.optimizer, run.optim, run.train.train_iters,
                                     run.train.global_batch_size)
        self.observer = TrainingObserver(run, self.model, None, 1)
        t = _tokens(s)
        batch = {"tokens": t[:, :-1], "labels": t[:, 1:],
                 "loss_mask": torch.ones(s["batch"], s["seq"])}
        self.data = iter(lambda: batch, None)
        self.iteration = 0

    def step(self) -> float:
        self.iteration += 1
        out = train_step(self.run, self.mesh, self.model, self.optimizer, self.scheduler,
                         self.data, self.iteration)
        out.update(self.observer.after_step())
        return out["lm loss"]


class TransformersSide:
    def __init__(self, s: dict) -> None:
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            num_key_value_heads=s["groups"], num_local_experts=s["experts"],
            num_experts_per_tok=s["topk"], max_position_embeddings=s["seq"],
            tie_word_embeddings=False, attn_implementation="sdpa")
        torch.manual_seed(0)
        self.model = MixtralForCausalLM(config).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        t = _tokens(s)
        self.inputs, self.labels = t[:, :-1], t[:, :-1]

    def step(self) -> float:
        loss = self.model(input_ids=self.inputs, labels=self.labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


def time_steps(side, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        side.step()
        out.append(time.perf_counter() - start)
    return out


def gemm_rate(tokens: int, h: int, f: int, repeats: int = 5) -> float:
    """FLOP/s of fp32 [tokens, H] x [H, F] forward + backward (3 GEMMs), best of repeats."""
    x = torch.randn(tokens, h, requires_grad=True)
    w = torch.randn(f, h, requires_grad=True)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        (x @ w.t()).sum().backward()
        best = min(best, time.perf_counter() - start)
        x.grad = w.grad = None
    return 3 * 2 * tokens * h * f / best


def step_gemm_flops(side: MegamoeSide) -> float:
    m = side.run.model
    tokens = side.run.train.global_batch_size * m.seq_length
    causal_attn = 6 * m.seq_length * m.num_attention_heads * m.kv_channels * m.num_layers
    return float(6 * active_matmul_parameters(m) * tokens + causal_attn * tokens)


def optimizer_seconds(side: MegamoeSide, repeats: int = 5) -> float:
    """megamoe's optimizer step alone (gradients present: clip + AdamW), best of repeats."""
    for p in side.optimizer.main_params:
        p.grad = torch.randn_like(p) * 1e-3
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        side.optimizer.step()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--megamoe-flags", default="", help="extra pretrain_gpt.py flags")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--json", action="store_true", help="(the output is always JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = SHAPE
    start = time.perf_counter()
    ours = MegamoeSide(s, args.megamoe_flags)
    sides = {"megamoe": ours}
    if not args.no_transformers:
        sides["transformers"] = TransformersSide(s)
    for side in sides.values():
        time_steps(side, args.warmup)
    setup_s = time.perf_counter() - start
    medians: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, side in sides.items():
            medians[name].append(statistics.median(time_steps(side, args.iters)))
    best = {name: min(v) for name, v in medians.items()}
    rate = gemm_rate(s["batch"] * s["seq"], s["hidden"], s["ffn"])
    flops = step_gemm_flops(ours)
    opt_s = optimizer_seconds(ours)
    floor = flops / rate + opt_s
    result = {"shape": s, "threads": args.threads, "megamoe_flags": args.megamoe_flags,
              "setup_and_warmup_s": round(setup_s, 2),
              "median_step_s_per_round": {k: [round(x, 4) for x in v]
                                          for k, v in medians.items()},
              "best_median_step_s": {k: round(v, 4) for k, v in best.items()},
              "step_gemm_gflop": round(flops / 1e9, 3), "gemm_gflops_per_s": round(rate / 1e9, 2),
              "optimizer_step_s": round(opt_s, 4), "floor_s": round(floor, 4),
              "megamoe_over_floor": round(best["megamoe"] / floor, 3)}
    if "transformers" in best:
        result["speedup_vs_transformers"] = round(best["transformers"] / best["megamoe"], 3)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
