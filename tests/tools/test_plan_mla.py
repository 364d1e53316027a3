"""The parallel-layout planner and --dry-run with multi-latent attention: parameter counts
by formula equal the built model's, the top layouts launch with pretrain_gpt.py
--dry-run, and context-parallel layouts are proposed with the ring's volume at MLA's
K (qk + pe) and V (v) head dims."""

from __future__ import annotations

import json
import shlex

import pytest

from megamoe.cli.main import main as pretrain_main
from tools import plan_parallel as pl

MLA_YAML = """\
num-layers: 4
hidden-size: 256
num-attention-heads: 16
seq-length: 4096
max-position-embeddings: 4096
position-embedding-type: rope
normalization: RMSNorm
swiglu: true
disable-bias-linear: true
untie-embeddings-and-output-weights: true
multi-latent-attention: true
q-lora-rank: 96
kv-lora-rank: 64
qk-head-dim: 32
qk-pos-emb-head-dim: 16
v-head-dim: 32
qk-layernorm: true
rotary-scaling-factor: 40
mscale: 1.0
mscale-all-dim: 1.0
num-experts: 16
moe-router-topk: 4
moe-ffn-hidden-size: 128
moe-grouped-gemm: true
moe-layer-freq: ([0]+[1]*3)
ffn-hidden-size: 512
bf16: true
"""


def test_planner_and_dry_run_with_mla(tmp_path, capsys, monkeypatch):
    path = tmp_path / "mla.yaml"
    path.write_text(MLA_YAML)
    model = pl.load_model(str(path), 32000, None)
    assert model.multi_latent_attention
    layouts = pl.legal_layouts(model, 16, 64, model.seq_length, 8)
    assert layouts and any(lay.cp > 1 for lay in layouts)
    assert pl.main(["--config", str(path), "--gpus", "16", "--gpu-memory-gb", "80",
                    "--global-batch-size", "64", "--vocab-size", "32000", "--json",
                    "--top", "3"]) == 0
    ranked = json.loads(capsys.readouterr().out)["layouts"]
    assert len(ranked) == 3
    monkeypatch.setenv("WORLD_SIZE", "16")
    cp2 = next(lay for lay in layouts if lay.cp == 2 and lay.tp == 2 and lay.pp == 1
               and lay.recompute == "none")
    ranked.append({"flags": " ".join(pl.layout_flags(model, cp2)), "mfu": 1.0})
    for r in ranked:
        assert r["mfu"] > 0
        argv = ["--config", str(path), "--dry-run", "--json", "--global-batch-size", "64",
                "--vocab-size", "32000", "--mock-data", "--tokenizer-type", "NullTokenizer",
                *shlex.split(r["flags"])]
        assert pretrain_main(argv) == 0, capsys.readouterr().err
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["parameters"] == report["parameters_formula"] > 0


def test_planner_cp_cost_uses_mla_head_dims(tmp_path):
    """An MLA layout's CP cost is the ring's bytes for every head's K at qk + pe = 48 and
    V at v = 32 channels per token (not kv_channels for both)."""
    from megamoe.parallel.context_parallel import ring_bytes_per_layer
    from megamoe.planning.planner import Hardware, step_time

    path = tmp_path / "mla.yaml"
    path.write_text(MLA_YAML)
    model = pl.load_model(str(path), 32000, None)
    lay = next(lay for lay in pl.legal_layouts(model, 16, 64, model.seq_length, 8)
               if lay.cp == 2 and lay.tp == 2 and lay.pp == 1 and lay.recompute == "none")
    hw = Hardware(gpus=16, gpu_memory_gb=80)
    got = step_time(model, lay, hw, model.seq_length, 64)["cp_comm"]
    tokens = 64 * model.seq_length / (lay.dp * lay.cp)
    want = ring_bytes_per_layer(16, 48, tokens, 2, 2, v_channels=32) * model.num_layers \
        / (hw.comm_efficiency * hw.intra_node_gbps * 1e9)
    assert got == pytest.approx(want, rel=1e-12)
    assert want != ring_bytes_per_layer(16, model.kv_channels, tokens, 2, 2) \
        * model.num_layers / (hw.comm_efficiency * hw.intra_node_gbps * 1e9)
