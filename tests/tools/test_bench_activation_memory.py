"""The activation memory benchmark runs end to end and the memory model of each recompute
mode (megamoe/planning/activations.py) matches the bytes measured for it: within 5% on
the tiny shape and on a scaled-down fine-grained one (the issue asks 25%; the model counts
what megamoe's layers keep, so it can be held tighter), and recompute lowers them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_tiny_json_within_5_percent():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools",
                                                       "bench_activation_memory.py"),
                          "--shapes", "tiny", "--json", "--threads", "1", "--max-error", "0.05"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    modes = json.loads(out.stdout)["shapes"]["tiny"]["modes"]
    assert set(modes) == {"none", "core_attn", "layernorm", "moe_act", "moe", "mlp",
                          "shared_experts", "full"}
    got = {m: v["measured_bytes_per_layer"] for m, v in modes.items()}
    assert got["full"] < got["moe"] < got["moe_act"] < got["layernorm"] < got["none"]
    assert got["mlp"] < modes["mlp"]["measured_bytes_per_layer_without_recompute"]
    assert got["shared_experts"] < modes["shared_experts"][
        "measured_bytes_per_layer_without_recompute"]


@pytest.mark.slow  # (the tiny shape below stays in the default set)
def test_fine_grained_shape_within_5_percent():
    sys.path.insert(0, ROOT)
    from tools import bench_activation_memory as bench

    shape = dict(E=32, k=8, H=128, F=32, S=128, heads=4, groups=2)
    for mode in ("none", "moe_act", "layernorm", "moe", "full"):
        config = bench.model_config(shape, 2)
        measured = bench.measure(config, mode, torch.float32)
        modelled = bench.modelled(config, mode, 4)
        assert abs(measured / modelled - 1) <= 0.05, (mode, measured, modelled)


def test_multi_latent_attention_within_25_percent():
    """MLA (model/mla.py) with and without q compression and latent norms: the memory model
    within the issue's 25% of the measured bytes; mla_up_proj drops q, k and v. (v as wide
    as q and k so that the CPU runs SDPA's flash kernel, which keeps no scores, as the GPU
    kernels; with a narrower v the CPU falls back to the math kernel.)"""
    import dataclasses

    sys.path.insert(0, ROOT)
    from tools import bench_activation_memory as bench

    shape = dict(E=8, k=2, H=64, F=32, S=64, heads=4, groups=4)
    for q_lora_rank, norms in ((32, True), (None, False)):
        config = dataclasses.replace(
            bench.model_config(shape, 2), multi_latent_attention=True, q_lora_rank=q_lora_rank,
            kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=24,
            qk_layernorm=norms)
        got = {}
        for mode in ("none", "core_attn", "mla_up_proj", "moe"):
            got[mode] = bench.measure(config, mode, torch.float32)
            modelled = bench.modelled(config, mode, 4)
            assert abs(got[mode] / modelled - 1) <= 0.25, (mode, got[mode], modelled)
        assert got["none"] - got["mla_up_proj"] >= 4 * 64 * 4 * (24 + 24 + 24) * 0.99
