"""--check-for-nan-in-loss-and-grad (Megatron's default on): a NaN/Inf in a rank's loss or
gradients stops the run before the optimizer step, on every rank, with one line naming the
iteration and the rank; the last checkpoint stays the last. Off, the step is skipped.

Faults are injected deterministically (tests/training/inject.py): the final norm's output
made NaN, or every parameter's gradient +Inf (no NaN anywhere, the loss finite), on one
rank during one training step.
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import subprocess
import sys

import pytest
import torch

from megamoe.cli.arguments import build_parser, parse_args
from megamoe.cli.main import main, pretrain
from megamoe.cli.mapping import run_config_from_args
from megamoe.cli.rules import _derive_defaults
from megamoe.parallel.mesh import single_process_mesh
from megamoe.training.build import build_model
from megamoe.training.checkpoint import TRACKER, read_checkpoint, read_tracker
from megamoe.training.loop import train_step
from megamoe.training.nonfinite import NonFiniteError
from megamoe.training.optim import build_optimizer
from megamoe.training.run_record import RUN_RECORDS
from megamoe.training.schedules.lr import LRScheduler
from tests.distributed import run_distributed
from tests.moe.test_host_syncs import HostSyncCounter
from tests.training.inject import install, poison, rank_main
from tests.training.test_pretrain import ROOT, TINY_MOE

OFF = "--no-check-for-nan-in-loss-and-grad"


def _one_line(code: int, err: str, needles: list[str]) -> str:
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_flag_defaults_on_as_in_megatron():
    on = parse_args(shlex.split(f"{TINY_MOE} --train-iters 1"), world_size=1)
    off = parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 {OFF}"), world_size=1)
    assert on.check_for_nan_in_loss_and_grad is True
    assert off.check_for_nan_in_loss_and_grad is False
    assert run_config_from_args(off, 97).train.check_for_nan_in_loss_and_grad is False
    assert run_config_from_args(on, 97).train.check_for_nan_in_loss_and_grad is True


@pytest.mark.parametrize("extra, check", [("--fp16", False), ("--fp16 --loss-scale 1024", True),
                                          ("--bf16", True)])
def test_fp16_dynamic_loss_scaling_turns_the_check_off(extra, check):
    """Megatron (arguments.py): NaN/Inf gradients are the dynamic loss scaler's signal."""
    args = build_parser().parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 {extra}"))
    assert isinstance(args, argparse.Namespace)
    _derive_defaults(args, world_size=1)
    assert args.check_for_nan_in_loss_and_grad is check


def _cli(spec: str, flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.training.inject", spec,
                           *shlex.split(f"{TINY_MOE} {flags}")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_nan_loss_stops_pretrain_gpt_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    save = tmp_path / "save"
    p = _cli("nan-loss:3:0", f"--train-iters 5 --save-interval 1 --save {save}")
    _one_line(p.returncode, p.stderr, ["iteration 3:", "NaN/Inf in the loss on rank 0", OFF])
    assert "iteration        2/" in p.stdout and "iteration        3/" not in p.stdout
    assert read_tracker(str(save)) == 2
    assert sorted(set(os.listdir(save)) - RUN_RECORDS) == ["iter_0000001", "iter_0000002", TRACKER]
    ckpt = read_checkpoint(str(save))
    assert ckpt["iteration"] == 2
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


def _components(flags: str):
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 4 {flags}"), world_size=1)
    run = run_config_from_args(args, 97)
    mesh = single_process_mesh(torch.device("cpu"))
    model = build_model(run, mesh)
    optimizer = build_optimizer(model, run.optim, mesh=mesh)
    return run, mesh, model, optimizer, LRScheduler(optimizer, run.optim,
                                                    run.train.train_iters)


def _batches(seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)  # host test data
    while True:
        tokens = torch.randint(0, 97, (2, 17), generator=g, device="cpu")
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
               "loss_mask": torch.ones(2, 16, device="cpu"),
               "position_ids": torch.arange(16, device="cpu").expand(2, 16)}


@pytest.mark.parametrize("precision", ["", "--bf16"])
@pytest.mark.parametrize("kind, what", [("nan-loss", "the loss"), ("inf-grad", "the gradients")])
def test_check_raises_before_the_optimizer_step(kind, what, precision):
    """Weights, fp32 main weights, Adam states and step count, and the LR schedule are
    exactly as before the failing step."""
    run, mesh, model, optimizer, scheduler = _components(precision)
    data = _batches(0)
    train_step(run, mesh, model, optimizer, scheduler, data, 1)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_state = copy.deepcopy(optimizer.state_dict())
    sched_state = copy.deepcopy(scheduler.state_dict())
    poison(model, kind, lambda: True)
    with pytest.raises(NonFiniteError) as e:
        train_step(run, mesh, model, optimizer, scheduler, data, 2)
    assert str(e.value).startswith(f"iteration 2: NaN/Inf in {what} on rank 0"), e.value
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
    after = optimizer.state_dict()
    flat_a, flat_b = _flatten(opt_state), _flatten(after)
    assert flat_a.keys() == flat_b.keys()
    for k, v in flat_a.items():
        assert (torch.equal(v, flat_b[k]) if isinstance(v, torch.Tensor)
                else v == flat_b[k]), k
    assert scheduler.state_dict() == sched_state


def _flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}/{k}"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}/{i}"))
        return out
    return {prefix: obj}


def _run_in_process(spec: str, flags: str, monkeypatch):
    install(spec, monkeypatch.setattr)
    args = parse_args(shlex.split(f"{TINY_MOE} {flags}"), world_size=1)
    return pretrain(args, print_fn=lambda _m: None)


def test_inf_gradient_with_finite_loss_is_caught(capsys, monkeypatch):
    install("inf-grad:2:0", monkeypatch.setattr)
    code = main(shlex.split(f"{TINY_MOE} --train-iters 3"))
    _one_line(code, capsys.readouterr().err,
              ["iteration 2:", "NaN/Inf in the gradients on rank 0"])


@pytest.mark.parametrize("kind, nan_iters", [("nan-loss", 1), ("inf-grad", 0)])
def test_check_off_skips_the_step_and_trains_on(monkeypatch, kind, nan_iters):
    state = _run_in_process(f"{kind}:2:0", f"--train-iters 3 {OFF}", monkeypatch)
    assert state.iteration == 3
    assert state.skipped_iters == 1 and state.nan_iters == nan_iters
    assert [h["iteration"] for h in state.history] == [1, 2, 3]
    assert not torch.isfinite(torch.tensor(state.history[1]["grad norm"]))
    assert torch.isfinite(torch.tensor(state.history[2]["lm loss"]))


@pytest.mark.parametrize("spec, flags, what", [
    # DP=2, distributed optimizer: only rank 1's loss (and so its gradients) is NaN
    pytest.param("nan-loss:2:1", "--use-distributed-optimizer", "the loss",
                 marks=pytest.mark.slow),
    # DP=2: only rank 1's local gradients are Inf; after the reduction every rank's are,
    # so this names rank 1 only if the check looks before the reduction
    pytest.param("inf-grad:2:1", "", "the gradients", marks=pytest.mark.slow),
    pytest.param("inf-grad:2:1", "--use-distributed-optimizer", "the gradients",
                 marks=pytest.mark.slow),
    # the same with the buckets reduced during the backward: each checked before its
    # collective is launched
    ("inf-grad:2:1", "--overlap-grad-reduce --ddp-bucket-size 3000", "the gradients"),
    pytest.param("inf-grad:2:1", "--use-distributed-optimizer --overlap-grad-reduce "
                 "--overlap-param-gather --ddp-bucket-size 3000", "the gradients",
                 marks=pytest.mark.slow),
    # PP=2: the loss is the last stage's (rank 1); the first stage gets an all-reduced copy
    ("nan-loss:2:1", "--pipeline-model-parallel-size 2", "the loss"),
])
def test_two_ranks_stop_together_naming_the_rank(tmp_path, spec, flags, what):
    save = tmp_path / "save"
    out = run_distributed(rank_main, 2, 180, spec,
                          f"{TINY_MOE} --train-iters 3 --save-interval 1 --save {save} "
                          f"{flags}")
    for code, err in out:
        _one_line(code, err, ["iteration 2:", f"NaN/Inf in {what} on rank 1"])
    assert read_tracker(str(save)) == 1
    assert sorted(set(os.listdir(save)) - RUN_RECORDS) == ["iter_0000001", TRACKER]


def test_the_check_adds_no_host_sync_to_a_step():
    """The agreed verdict is read with the gradient norm, in the step's one host read."""
    totals = {}
    for flags in ("", OFF):
        run, mesh, model, optimizer, scheduler = _components(flags)
        data = _batches(0)
        train_step(run, mesh, model, optimizer, scheduler, data, 1)
        with HostSyncCounter() as counter:
            train_step(run, mesh, model, optimizer, scheduler, data, 2)
        totals[flags] = counter.total
    assert totals[""] == totals[OFF], totals


def _inf_after_update(monkeypatch, at: int) -> None:
    """The `at`-th optimizer update leaves +Inf in one weight (an update that overflowed;
    the loss and the gradients it came from were finite)."""
    from megamoe.training.optim.mixed_precision import MixedPrecisionOptimizer

    update, calls = MixedPrecisionOptimizer.clip_and_update, []

    def overflowing(self, grads, norm):
        update(self, grads, norm)
        calls.append(1)
        if len(calls) == at:
            with torch.no_grad():
                self.model_params[0].view(-1)[0] = float("inf")

    monkeypatch.setattr(MixedPrecisionOptimizer, "clip_and_update", overflowing)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_no_checkpoint_holds_inf_weights(tmp_path, monkeypatch, capsys, fmt):
    """Inf weights after the update of a saving iteration: one line, nothing written for
    it, the previous checkpoint stays the last; --no-check-... writes them (opt-out)."""
    _inf_after_update(monkeypatch, at=2)
    save = tmp_path / "save"
    code = main(shlex.split(f"{TINY_MOE} --train-iters 4 --save-interval 1 --save {save} "
                            f"--ckpt-format {fmt}"))
    err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True)
                  if not line.startswith("megamoe.data: "))  # (data layer's progress lines)
    _one_line(code, err,
              ["iteration 2:", "NaN/Inf in the parameters after the update on rank 0", OFF])
    assert sorted(set(os.listdir(save)) - RUN_RECORDS) == ["iter_0000001", TRACKER]
    _inf_after_update(monkeypatch, at=2)
    off = tmp_path / "off"
    assert main(shlex.split(f"{TINY_MOE} --train-iters 2 --save-interval 1 --save {off} "
                            f"--ckpt-format {fmt} {OFF}")) == 0
    assert not all(torch.isfinite(v).all() for v in read_checkpoint(str(off))["model"].values())


def test_parameter_check_runs_on_saving_iterations_only(tmp_path, monkeypatch):
    """Its host read happens at saves only: the other steps keep their one sync."""
    from megamoe.training.checkpoint import manager

    seen, check = [], manager.check_params_before_save
    monkeypatch.setattr(manager, "check_params_before_save",
                        lambda params, it, *a: (seen.append(it), check(params, it, *a)))
    pretrain(parse_args(shlex.split(f"{TINY_MOE} --train-iters 5 --save-interval 2 "
                                    f"--save {tmp_path / 's'}"), world_size=1),
             print_fn=lambda _m: None)
    assert seen == [2, 4, 5]
