"""Smoke test: the MoE benchmark runs end to end on its tiny shape and prints its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_tiny_json():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_moe_layer.py"),
                          "--tiny", "--json", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=120, check=True)
    (r,) = json.loads(out.stdout)["results"]
    for key in ("moe_ms", "loop_ms", "einsum_ms", "dense_ms", "ratio_vs_dense",
                "speedup_vs_loop", "speedup_vs_einsum", "peak_mem_ratio_vs_dense"):
        assert r[key] > 0, key
    assert r["shape"] == "tiny" and r["dtype"] == "fp32"
    assert set(r["saved_tensors"]) == {"moe", "dense"} and r["saved_mib"]["dense"] > 0


def test_moe_saves_at_most_1_3x_dense_activations():
    """Scaled-down fine_grained (F < H) and mixtral (F > H) shapes: what autograd keeps for
    the MoE layer stays within 1.3x of the dense SwiGLU of the same FLOPs (issue 3)."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_moe_layer as bench

    from megamoe.config import MoEConfig
    from megamoe.moe.layer import MoELayer

    for E, k, H, F_ in ((16, 4, 128, 32), (8, 2, 128, 256)):
        torch.manual_seed(0)
        cfg = MoEConfig(num_experts=E, topk=k, ffn_hidden_size=F_)
        layer = MoELayer(cfg, H, init_method_std=0.02, swiglu=True, grouped_gemm=True)
        dense = bench.DenseSwiGLU(H, k * F_, torch.float32)
        x = torch.randn(512, H)
        moe_b = bench.saved_activation_bytes(layer, x)
        dense_b = bench.saved_activation_bytes(dense, x)
        assert moe_b <= 1.3 * dense_b, (E, k, H, F_, moe_b / dense_b)
        # No [N, H] tensor (N = k * T token copies) is kept: the gather is fused into fc1
        # and the combine's index_add keeps only indices.
        shapes = [shape for _, shape, _ in bench.saved_tensors(layer, x)]
        assert [512 * k, H] not in shapes or F_ > H, shapes
