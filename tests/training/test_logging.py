"""Observability: TensorBoard event file and W&B offline run carry every scalar family and
the expert-load heatmap (a labelled figure; its geometry, labels and colours in
test_heatmap.py); the expert-load statistics equal a direct count of the routing."""

from __future__ import annotations

import glob
import os
import shlex

import numpy as np
import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.heatmap import heatmap_geometry
from megamoe.training.metrics import (
    expert_load_scalars,
    format_log_line,
    memory_scalars,
    peak_tflops,
)
from tests.training.test_pretrain import TINY_MOE


def _events(tb_dir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("logged")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    lines: list[str] = []
    args = parse_args(shlex.split(
        f"{TINY_MOE} --train-iters 4 --log-interval 2 --moe-per-layer-logging "
        f"--tensorboard-dir {out / 'tb'} --wandb-project megamoe-test --wandb-exp-name t "
        f"--wandb-save-dir {out / 'wandb'} --log-throughput --peak-tflops 0.05 "
        f"--log-first-iterations 0"), world_size=1)  # Megatron's console: lines at 2 and 4
    state = pretrain(args, print_fn=lines.append)
    return out, lines, state


def test_tensorboard_has_every_scalar_family_and_the_heatmap(logged_run):
    out, _, _ = logged_run
    acc = _events(str(out / "tb"))
    tags = set(acc.Tags()["scalars"])
    expected = {
        "lm_loss", "grad_norm", "learning_rate", "loss-scale", "consumed_samples",
        "load_balancing_loss", "z_loss",
        "load_balancing_loss/layer_00", "load_balancing_loss/layer_01",
        "z_loss/layer_00", "z_loss/layer_01",
        "moe/max_over_mean_load", "moe/load_cv", "moe/dropped_fraction",
        "moe/layer_00/max_over_mean_load", "moe/layer_01/load_cv",
        "moe/layer_01/dropped_fraction",
        "iteration_time_ms", "throughput_tokens_per_sec", "throughput_tflops_per_gpu", "mfu",
        "memory/rss_gib",
    }
    assert expected <= tags, expected - tags
    assert [e.step for e in acc.Scalars("lm_loss")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("mfu")] == [2, 4]
    for e in acc.Scalars("moe/max_over_mean_load"):
        assert e.value >= 1.0
    assert all(e.value == 0.0 for e in acc.Scalars("moe/dropped_fraction"))  # dropless
    images = acc.Images("moe/expert_load_heatmap")
    assert [im.step for im in images] == [2, 4]
    g = heatmap_geometry(2, 4)  # the labelled figure of 2 MoE layers x 4 experts
    assert (images[0].height, images[0].width) == (g.height, g.width)
    assert g.width > 300 and g.height > 200


def test_per_layer_losses_average_to_the_console_value(logged_run):
    out, _, state = logged_run
    for h in state.history:
        per_layer = [h[f"load_balancing_loss/layer_{i:02d}"] for i in range(2)]
        assert abs(np.mean(per_layer) - h["load_balancing_loss"]) < 1e-6


def test_mfu_is_model_flops_over_peak(logged_run):
    from megamoe.cli.mapping import run_config_from_args
    from megamoe.model.flops import flops_per_token

    out, _, _ = logged_run
    acc = _events(str(out / "tb"))
    run = run_config_from_args(parse_args(shlex.split(TINY_MOE + " --train-iters 1"),
                                     world_size=1), 97)  # NullTokenizer --vocab-size 97: 97 ids
    tokens_per_iter = 8 * 16
    for mfu, ms in zip(acc.Scalars("mfu"), acc.Scalars("iteration_time_ms")):
        expect = flops_per_token(run.model) * tokens_per_iter / (ms.value / 1000) / 0.05e12
        assert abs(mfu.value - expect) <= 1e-4 * expect


def test_console_line_keeps_megatron_format(logged_run):
    _, lines, _ = logged_run
    it_lines = [ln for ln in lines if "iteration " in ln and "consumed samples" in ln]
    assert len(it_lines) == 2 and "iteration        4/       4" in it_lines[-1]
    assert "throughput per GPU (TFLOP/s/GPU):" in it_lines[-1]
    assert "/layer_" not in it_lines[-1] and "moe/" not in it_lines[-1]


def test_wandb_offline_run_directory(logged_run):
    out, _, _ = logged_run
    runs = glob.glob(str(out / "wandb" / "wandb" / "offline-run-*"))
    assert runs, os.listdir(out / "wandb")
    assert glob.glob(os.path.join(runs[0], "*.wandb"))


def test_expert_load_scalars_against_direct_count():
    kept = np.array([6.0, 2.0, 0.0, 0.0])
    routed = np.array([6.0, 4.0, 1.0, 1.0])
    out = expert_load_scalars({3: {"kept": kept, "routed": routed}}, per_layer=True)
    assert out["moe/layer_03/max_over_mean_load"] == pytest.approx(6.0 / 2.0)
    assert out["moe/layer_03/load_cv"] == pytest.approx(np.std(kept) / 2.0)
    assert out["moe/layer_03/dropped_fraction"] == pytest.approx(4.0 / 12.0)
    assert out["moe/load_cv"] == out["moe/layer_03/load_cv"]


def test_peak_is_given_or_a_known_gpu_never_a_cpu_matmul(monkeypatch):
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, None) is None and peak_tflops(cpu, 12.5) == 12.5
    gpu = torch.device("cuda", 0)
    for name, want in (("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA H200", 989.0),
                       ("NVIDIA B200", 2250.0), ("Some Other GPU", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d, n=name: n)
        assert peak_tflops(gpu, None) == want, name


def test_memory_measurement():
    rss = memory_scalars(torch.device("cpu"))["memory/rss_gib"]
    assert 0.01 < rss < 64


def test_format_log_line_without_throughput_flag():
    line = format_log_line(iteration=2, train_iters=2, consumed_samples=16,
                           elapsed_ms_per_iter=1.0, tokens_per_sec=1.0, learning_rate=1e-3,
                           global_batch_size=8, losses={"lm loss": 1.0}, loss_scale=1.0,
                           grad_norm=1.0, skipped_iters=0, nan_iters=0)
    assert "iteration        2/       2" in line and "TFLOP" not in line
