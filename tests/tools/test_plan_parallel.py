"""tools/plan_parallel.py: memory model against measured tensors of the tiny preset (single
process and data parallel, fp32 and bf16), legal layouts only, JSON output."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import plan_parallel as pl  # noqa: E402

from megamoe.arguments import parse_args  # noqa: E402
from megamoe.configs_from_args import args_to_configs  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
VOCAB = 256


def _measured_static_bytes(bf16: bool, world_size: int) -> tuple[float, object]:
    """Bytes of every tensor the model and optimizer hold after one step."""
    from megamoe.parallel.optimizer import build_optimizer
    from megamoe.training.pretrain import build_model

    args = parse_args(shlex.split(f"--config {TINY} --mock-data --train-iters 1 --lr 1e-3 "
                                  f"--micro-batch-size 2 {'--bf16' if bf16 else ''}"),
                      world_size=world_size)
    run = args_to_configs(args, VOCAB)
    model = build_model(run, bf16)
    opt = build_optimizer(model, run.optim)
    tokens = torch.randint(0, VOCAB, (2, run.model.seq_length))
    model(tokens, labels=tokens).float().mean().backward()
    opt.step()
    seen: set[int] = set()
    total = 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen and t.numel() > 1:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for m in opt.main_params:
        add(m)
        add(m.grad)
    for st in opt.optimizer.state.values():
        for v in st.values():
            add(v)
    return float(total), run.model


def _predicted(model, bf16: bool, dp: int) -> float:
    lay = pl.Layout(1, 1, 1, 1, 1, dp, 1, False, "none", 2)
    m = pl.model_bytes(model, lay, param_bytes=2 if bf16 else 4)
    return m["weights"] + m["gradients"] + m["optimizer"]


def _dp_worker(rank: int, world_size: int, bf16: bool) -> float:
    return _measured_static_bytes(bf16, world_size)[0]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_static_memory_single_process_within_10_percent(bf16):
    measured, model = _measured_static_bytes(bf16, 1)
    predicted = _predicted(model, bf16, 1)
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_static_memory_data_parallel_within_10_percent(bf16):
    per_rank = run_distributed(_dp_worker, 2, 120, bf16)
    _, model = _measured_static_bytes(bf16, 1)
    predicted = _predicted(model, bf16, 2)
    for measured in per_rank:
        assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


def _rules_accept(model_flags: str, lay: pl.Layout, gpus: int, gbs: int) -> None:
    """The argument rules accept the layout (or stop only at "not supported yet")."""
    argv = (f"--config {model_flags} --dry-run --global-batch-size {gbs} "
            f"--tensor-model-parallel-size {lay.tp} --pipeline-model-parallel-size {lay.pp} "
            f"--context-parallel-size {lay.cp} --expert-model-parallel-size {lay.ep} "
            f"--expert-tensor-parallel-size {lay.etp} --micro-batch-size {lay.micro_batch_size}"
            + (" --sequence-parallel" if lay.tp > 1 else "")
            + (" --use-distributed-optimizer" if lay.distributed_optimizer else ""))
    from megamoe.argument_rules import ArgumentError, finalize_args
    from megamoe.arguments import build_parser, expand_config_file

    parser = build_parser()
    args = parser.parse_args(expand_config_file(shlex.split(argv)))
    try:
        finalize_args(args, parser, world_size=gpus)
    except ArgumentError as e:
        assert str(e).startswith("not supported yet"), (lay, str(e))


@pytest.mark.parametrize("preset,gpus", [("mixtral-8x7b.yaml", 64), ("tiny.yaml", 8)])
def test_never_proposes_illegal_layouts(preset, gpus):
    path = os.path.join(ROOT, "configs", preset)
    model = pl.load_model(path, 32000, None)
    layouts = pl.legal_layouts(model, gpus, 256, model.seq_length, 8)
    assert layouts
    for lay in layouts:
        assert lay.tp * lay.pp * lay.cp * lay.dp == gpus
        assert model.num_attention_heads % lay.tp == 0 and model.num_query_groups % lay.tp == 0
        assert model.num_layers % (lay.pp * lay.vpp) == 0
        assert model.moe.num_experts % lay.ep == 0 and (gpus // lay.pp) % (lay.ep * lay.etp) == 0
        assert 256 % (lay.micro_batch_size * lay.dp) == 0
        assert not (lay.vpp > 1 and lay.pp == 1)
    for lay in layouts[:: max(1, len(layouts) // 40)]:
        _rules_accept(path, lay, gpus, 256)
    ranked = pl.plan(model, pl.Hardware(gpus, 80), model.seq_length, 256, top=50)
    assert all(pl.Layout(**r["layout"]) in set(layouts) for r in ranked)
    assert all(r["memory_gb"]["total"] <= 0.9 * 80 for r in ranked)


def test_cli_json_and_explanations():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_parallel.py"),
                        "--config", os.path.join(ROOT, "configs", "mixtral-8x7b.yaml"),
                        "--gpus", "64", "--gpu-memory-gb", "80", "--json", "--top", "3"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["layouts"]) == 3
    times = [r["step_time_s"]["total"] for r in out["layouts"]]
    assert times == sorted(times)
    for r in out["layouts"]:
        assert set(r) >= {"layout", "memory_gb", "step_time_s", "tflops_per_gpu", "mfu",
                          "explanation"}
        assert "\n" not in r["explanation"] and r["explanation"].startswith("TP")


def test_cli_bad_input_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_parallel.py"),
                        "--config", str(tmp_path / "nope.yaml"), "--gpus", "8",
                        "--gpu-memory-gb", "80"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "nope.yaml" in p.stderr and "Traceback" not in p.stderr
