"""The parallel-layout planner and --dry-run with multi-latent attention: parameter counts
by formula equal the built model's, no proposed layout uses context parallelism (refused
with MLA), and the top layouts launch with pretrain_gpt.py --dry-run."""

from __future__ import annotations

import json
import shlex

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
    assert layouts and all(lay.cp == 1 for lay in layouts)
    assert pl.main(["--config", str(path), "--gpus", "16", "--gpu-memory-gb", "80",
                    "--global-batch-size", "64", "--vocab-size", "32000", "--json",
                    "--top", "3"]) == 0
    ranked = json.loads(capsys.readouterr().out)["layouts"]
    assert len(ranked) == 3
    monkeypatch.setenv("WORLD_SIZE", "16")
    for r in ranked:
        assert r["layout"]["cp"] == 1 and r["mfu"] > 0
        argv = ["--config", str(path), "--dry-run", "--global-batch-size", "64",
                "--vocab-size", "32000", "--mock-data", "--tokenizer-type", "NullTokenizer",
                *shlex.split(r["flags"])]
        assert pretrain_main(argv) == 0, capsys.readouterr().err
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["parameters"] == report["parameters_formula"] > 0
