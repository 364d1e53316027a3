"""Activation bytes per rank under context parallelism (JSON): one training forward of
the tiny MoE model's layers on this cp rank's part of a long sequence, counting what it
keeps for backward (tools/memory_tracking.py), for CP = 1, 2, 4 on gloo ranks.

    python tools/bench_cp_memory.py --seq-length 16384 --cp 1 2 4

CP = 1 runs causal SDPA; CP > 1 runs parallel/context_parallel.py's ring (which keeps
q, k, v, the output and the log-sum-exp per layer). Step times on 2 cores would be
oversubscribed: only bytes are reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe.config import ModelConfig, MoEConfig  # noqa: E402
from megamoe.model.gpt_model import GPTModel, rotary_for  # noqa: E402
from megamoe.model.transformer_block import run_layers  # noqa: E402
from megamoe.parallel.cp_layout import cp_positions  # noqa: E402
from megamoe.parallelize import apply_context_parallel  # noqa: E402
from tools.gloo_ranks import run_gloo_ranks  # noqa: E402
from tools.memory_tracking import TensorMemoryTracker  # noqa: E402


def tiny(seq_length: int) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                       num_attention_heads=4, num_query_groups=2, seq_length=seq_length,
                       max_position_embeddings=seq_length, vocab_size=97,
                       position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                       add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                       moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=64))


def _body(rank: int, world: int, args: argparse.Namespace) -> float:
    import torch.distributed as dist

    config = tiny(args.seq_length)
    torch.manual_seed(0)
    model = GPTModel(config)
    if world > 1:
        apply_context_parallel(model, dist.group.WORLD, ["p2p"])
    model.train()
    s_local, h = args.seq_length // world, config.hidden_size
    x_SBH = torch.randn(s_local, 1, h, requires_grad=True)
    pos_BS = cp_positions(s_local, rank, world, torch.device("cpu"))[None]
    rotary = rotary_for(config, torch.zeros(1, s_local, dtype=torch.long), pos_BS)
    with TensorMemoryTracker() as tracker:
        out = run_layers(model.decoder.layers, x_SBH, rotary)
        kept = tracker.live - out.untyped_storage().nbytes() + x_SBH.untyped_storage().nbytes()
    out.sum().backward()
    return kept / config.num_layers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=16384)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    per_layer = {cp: run_gloo_ranks(_body, cp, a, a.timeout, "bench_cp_memory")
                 for cp in a.cp}
    base = per_layer.get(1)
    print(json.dumps({"seq_length": a.seq_length, "model": "tiny MoE (2 layers, H=64, fp32)",
                      "activation_bytes_per_layer_per_rank": per_layer,
                      "ratio_to_cp1": {cp: v / base for cp, v in per_layer.items()}
                      if base else None}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
