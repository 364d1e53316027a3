"""--fp16 with Megatron-LM's loss scaling (training/optim/grad_scaler.py).

The reference for the scale's sequence is Megatron's DynamicGradScaler.update, transcribed
below from megatron/core/optimizer/grad_scaler.py (Megatron-LM d98e8a64) with its fp32
tensors; everything else compares an fp16 run with the same run in fp32, or a step with
the step it would have been.
"""

from __future__ import annotations

import copy
import os
import random
import shlex
import shutil
from typing import Callable

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import OptimizerConfig
from megamoe.moe.losses import MoELossTracker
from megamoe.parallel.mesh import single_process_mesh
from megamoe.training import loop
from megamoe.training import pretrain as pretrain_module
from megamoe.training.build import build_model
from megamoe.training.checkpoint.fields import check_fields
from megamoe.training.checkpoint.safe_load import CheckpointError
from megamoe.training.optim import MixedPrecisionOptimizer, build_optimizer
from megamoe.training.schedules import forward_backward_no_pipelining
from megamoe.training.schedules.lr import LRScheduler
from tests.flags import parse_error
from tests.moe.test_host_syncs import HostSyncCounter
from tests.training.test_pretrain import TINY_MOE, _dry_run_memory


class MegatronDynamicGradScaler:
    """Megatron-LM's DynamicGradScaler (grad_scaler.py at d98e8a64): __init__'s state and
    update(), verbatim but for device='cuda' (the scale is its fp32 tensor, on the CPU)."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor,
                 growth_interval, hysteresis):
        self._scale = torch.tensor([initial_scale], dtype=torch.float)
        self.min_scale = torch.tensor([min_scale], dtype=torch.float)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor


# X: an overflowing step. Covers: hysteresis absorbing one overflow, backoffs on each
# overflow once it is spent (the tracker goes below zero), the floor, growth after a clean
# window restoring the hysteresis, a window cut short by an overflow, a non-power-of-2 start.
PATTERN = "X..X.X....XXXXXXXX.......X..X...X.X.X......XX..............."


def _fp16_linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3, bias=False).half()


def test_scale_sequence_equals_megatrons_dynamic_grad_scaler():
    """Through the optimizer: each step's backward runs at get_loss_scale(), an Inf is
    injected into one gradient element on the X steps; the scale before every step, the
    trackers after it and which steps updated equal Megatron's rule; the clean steps'
    unscaled fp32 gradients are exact (powers of 2 both ways)."""
    config = OptimizerConfig(lr=1e-3, fp16=True, initial_loss_scale=3 * 2.0**10,
                             min_loss_scale=2.0**8, loss_scale_window=3, hysteresis=2,
                             clip_grad=0.0)
    model = _fp16_linear()
    opt = MixedPrecisionOptimizer(model, config)
    ref = MegatronDynamicGradScaler(3 * 2.0**10, 2.0**8, 2.0, 0.5, 3, 2)
    hit_floor = False
    for step, mark in enumerate(PATTERN):
        assert opt.get_loss_scale() == float(ref._scale), step
        opt.zero_grad()
        w, main = model.weight, opt.main_params[0]
        hook = w.register_hook(lambda g, bad=mark == "X": g.index_fill(
            1, torch.tensor([2]), float("inf")) if bad else g)
        (w.float() * 2.0**-16).sum().mul(opt.get_loss_scale()).backward()
        hook.remove()
        before = main.detach().clone()
        updated, _, _ = opt.step()
        ref.update(mark == "X")
        assert updated == (mark == "."), step
        assert torch.equal(main, before) != updated, step
        if updated:  # d/dw of sum(w * 2^-16), unscaled exactly
            assert torch.equal(opt.main_params[0].grad, torch.full((3, 4), 2.0**-16)), step
        state = opt.grad_scaler.state_dict()
        assert (state["growth_tracker"], state["hysteresis_tracker"]) == (
            ref._growth_tracker, ref._hysteresis_tracker), step
        hit_floor |= float(ref._scale) == 2.0**8
    assert hit_floor and opt.get_loss_scale() > 3 * 2.0**10  # floor reached, grown back


def test_constant_loss_scale_skips_overflows_and_keeps_its_scale():
    """--loss-scale (Megatron's ConstantGradScaler, also with --bf16): the backward runs at
    the fixed scale, an overflow skips the step, the scale never moves."""
    model = torch.nn.Linear(4, 3, bias=False).bfloat16()
    opt = MixedPrecisionOptimizer(model, OptimizerConfig(lr=1e-3, bf16=True, loss_scale=64.0))
    for mark in "X.X":
        opt.zero_grad()
        scale = float("inf") if mark == "X" else opt.get_loss_scale()
        model.weight.float().sum().mul(scale).backward()
        assert opt.step()[0] == (mark == ".")
        assert opt.get_loss_scale() == 64.0 and opt.grad_scaler.state_dict() == {}


def _snapshot(model, optimizer, scheduler) -> tuple:
    state = copy.deepcopy(optimizer.state_dict())
    state.pop("grad_scaler")
    return ({n: p.detach().clone() for n, p in model.named_parameters()}, state,
            copy.deepcopy(scheduler.state_dict()), optimizer.param_groups[0]["lr"])


def _assert_same(a, b) -> None:
    params_a, opt_a, sched_a, lr_a = a
    params_b, opt_b, sched_b, lr_b = b
    for n in params_a:
        assert torch.equal(params_a[n], params_b[n]), n
    for pa, pb in zip(opt_a["main_params"], opt_b["main_params"]):
        assert torch.equal(pa, pb)
    for k, st in opt_a["optimizer"]["state"].items():
        for name, v in st.items():
            assert torch.equal(v, opt_b["optimizer"]["state"][k][name]), (k, name)
    assert sched_a == sched_b and lr_a == lr_b


def test_overflow_skips_the_step_but_counts_the_iteration(monkeypatch):
    """An Inf in one gradient element at iteration 2 (--hysteresis 1: the scale halves at
    once): weights, fp32 main weights, Adam's states and step, the LR schedule and the LR
    are exactly as before the step; the iteration and its samples count; the log line
    shows the skip and the new scale, and no NaN iteration (the loss was finite)."""
    seen: dict[int, tuple] = {}
    poisoned = {"on": False}
    train_step, build = loop.train_step, pretrain_module.build_model

    def building(run, mesh=None):
        model = build(run, mesh)
        w = next(p for n, p in model.named_parameters() if "experts" in n)
        w.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))
                        if poisoned["on"] else g)
        return model

    def stepping(run, mesh, model, optimizer, scheduler, data_iter, iteration, *a, **k):
        poisoned["on"] = iteration == 2
        before = _snapshot(model, optimizer, scheduler)
        out = train_step(run, mesh, model, optimizer, scheduler, data_iter, iteration,
                         *a, **k)
        seen[iteration] = (before, _snapshot(model, optimizer, scheduler),
                           optimizer.get_loss_scale(), out["skipped"])
        return out

    monkeypatch.setattr(pretrain_module, "build_model", building)
    monkeypatch.setattr(loop, "train_step", stepping)
    lines: list[str] = []
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 3 --fp16 --initial-loss-scale "
                                  "4096 --hysteresis 1"), world_size=1)
    state = pretrain(args, print_fn=lines.append)
    _assert_same(*seen[2][:2])
    assert [seen[i][2:] for i in (1, 2, 3)] == [(4096.0, 0.0), (2048.0, 1.0), (2048.0, 0.0)]
    assert not torch.equal(seen[3][0][0]["output_layer.weight"],
                           seen[3][1][0]["output_layer.weight"])  # iteration 3 updates
    assert (state.iteration, state.consumed_train_samples) == (3, 24)
    assert (state.skipped_iters, state.nan_iters) == (1, 0)
    assert "grad norm" not in state.history[1]  # (Megatron logs none for a skipped step)
    line = next(x for x in lines if "iteration        2/" in x)
    assert "loss scale: 2048.0" in line and "number of skipped iterations:   1" in line
    assert "number of nan iterations:   0" in line and "grad norm" not in line
    assert "lm loss" not in line  # averaged over updating iterations only: none here


def test_fp16_training_follows_fp32():
    """Eight iterations of the tiny MoE model, --fp16 (start scale 2^12: no overflow) vs
    fp32: LM loss within 1e-3 and gradient norm within 1% at every iteration. Bounds:
    fp16 rounds the weights and activations to 11 significant bits (relative 4.9e-4); the
    loss of this model sits at ~4.5 with small logits: measured here, the loss gap is at
    most 4.8e-6 and the norm gap 0.009% (x200 and x100 margins for other CPUs' kernels).
    A gradient left scaled would be 4096x the norm (tried: the norm check fails)."""
    flags = "--train-iters 8 --lr 1e-3"
    fp32 = pretrain(parse_args(shlex.split(f"{TINY_MOE} {flags}"), world_size=1),
                    print_fn=lambda _m: None).history
    fp16 = pretrain(parse_args(shlex.split(f"{TINY_MOE} {flags} --fp16 --initial-loss-scale "
                                           "4096"), world_size=1),
                    print_fn=lambda _m: None).history
    for a, b in zip(fp32, fp16):
        assert abs(a["lm loss"] - b["lm loss"]) < 1e-3, (a, b)
        assert abs(a["grad norm"] - b["grad norm"]) < 0.01 * a["grad norm"], (a, b)
    assert fp16[-1]["lm loss"] < fp16[0]["lm loss"] - 0.01  # it trains


def _micro_batches(seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)  # host test data
    for _ in range(2):
        tokens = torch.randint(0, 97, (2, 17), generator=g, device="cpu")
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
               "loss_mask": torch.ones(2, 16, device="cpu"),
               "position_ids": torch.arange(16, device="cpu").expand(2, 16)}


@pytest.mark.parametrize("extra", ["", "--mtp-num-layers 1 --calculate-per-token-loss"])
def test_every_gradient_carries_the_loss_scale(extra):
    """The backward at loss scale 2^10 gives exactly 2^10 x every gradient of the unscaled
    backward (fp32 model: powers of 2 are exact), the router's included: the MoE aux
    losses inject their gradients inside the backward (moe/losses.py), as MTP's per-token
    loss does with its own backward scale; without the loss scale on them the unscaled
    router gradient would lose its aux-loss part (Megatron's MoEAuxLossAutoScaler)."""
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 {extra}"), world_size=1)
    run = run_config_from_args(args, 97)
    model = build_model(run, single_process_mesh(torch.device("cpu")))
    grads = []
    for scale in (1.0, 2.0**10):
        model.zero_grad()
        per_token = loop.per_token_loss(run, single_process_mesh(torch.device("cpu")))
        forward_backward_no_pipelining(model, _micro_batches(0), 2, per_token=per_token,
                                       loss_scale=scale)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    MoELossTracker.clear()
    routers = [n for n in grads[0] if "router" in n]
    assert routers
    for n, g in grads[0].items():
        assert torch.equal(grads[1][n], g * 2.0**10), n


def _capture_optimizer(monkeypatch) -> list:
    made: list = []
    build = pretrain_module.build_optimizer

    def building(*a, **k):
        made.append(build(*a, **k))
        return made[-1]

    monkeypatch.setattr(pretrain_module, "build_optimizer", building)
    return made


@pytest.mark.parametrize("fmt", ["torch_dist", pytest.param("torch", marks=pytest.mark.slow)])
def test_resume_continues_the_scalers_state(tmp_path, monkeypatch, fmt):
    """Window 3: saved at iteration 2 with the growth tracker at 2, so iteration 3 doubles
    the scale only if the resumed run restored it; the resumed losses, scale and trackers
    equal the uninterrupted run's (same process)."""
    made = _capture_optimizer(monkeypatch)
    flags = (f"{TINY_MOE} --fp16 --initial-loss-scale 4096 --loss-scale-window 3 "
             f"--ckpt-format {fmt} --save-interval 2")
    full = pretrain(parse_args(shlex.split(f"{flags} --train-iters 4 --save {tmp_path}/a"),
                               world_size=1), print_fn=lambda _m: None)
    full_scaler = made[-1].grad_scaler.state_dict()
    pretrain(parse_args(shlex.split(f"{flags} --train-iters 2 --save {tmp_path}/b"),
                        world_size=1), print_fn=lambda _m: None)
    assert made[-1].grad_scaler.state_dict()["growth_tracker"] == 2
    resumed = pretrain(parse_args(shlex.split(f"{flags} --train-iters 4 --load {tmp_path}/b "
                                              f"--save {tmp_path}/b"),
                                  world_size=1), print_fn=lambda _m: None)
    assert made[-1].grad_scaler.state_dict() == full_scaler
    assert full_scaler == {"scale": 8192.0, "growth_tracker": 1, "hysteresis_tracker": 2}
    assert [h["lm loss"] for h in resumed.history] == [h["lm loss"] for h in full.history[2:]]


def test_a_checkpoint_without_a_scaler_loads_into_fp16(tmp_path, monkeypatch):
    """A checkpoint an fp32 run wrote (no grad_scaler: also every older checkpoint) loads
    into an --fp16 run, whose scaler starts from --initial-loss-scale, as Megatron's."""
    made = _capture_optimizer(monkeypatch)
    pretrain(parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 --save {tmp_path}"),
                        world_size=1), print_fn=lambda _m: None)
    state = pretrain(parse_args(shlex.split(f"{TINY_MOE} --train-iters 2 --load {tmp_path} "
                                            "--fp16 --initial-loss-scale 1024"),
                                world_size=1), print_fn=lambda _m: None)
    assert state.iteration == 2 and made[-1].get_loss_scale() == 1024.0


@pytest.mark.parametrize("scaler, field", [
    ([], "optimizer.grad_scaler"),
    ({"scale": float("inf"), "growth_tracker": 0, "hysteresis_tracker": 2},
     "optimizer.grad_scaler.scale"),
    ({"scale": -1.0, "growth_tracker": 0, "hysteresis_tracker": 2},
     "optimizer.grad_scaler.scale"),
    ({"scale": 1e39, "growth_tracker": 0, "hysteresis_tracker": 2},
     "optimizer.grad_scaler.scale"),
    ({"scale": 2.0, "growth_tracker": -1, "hysteresis_tracker": 2},
     "optimizer.grad_scaler.growth_tracker"),
    ({"scale": 2.0, "growth_tracker": 0, "hysteresis_tracker": "2"},
     "optimizer.grad_scaler.hysteresis_tracker"),
])
def test_a_damaged_scaler_field_is_one_error_naming_it(scaler, field):
    state = {"iteration": 2, "consumed_train_samples": 16,
             "optimizer": {"optimizer": {}, "grad_scaler": scaler}}
    with pytest.raises(CheckpointError, match=f"field '{field}'"):
        check_fields("ckpt/model_optim_rng.pt", state)
    state["optimizer"]["grad_scaler"] = {"scale": 2.0**20, "growth_tracker": 3,
                                         "hysteresis_tracker": -4}  # (below 0: allowed)
    check_fields("ckpt/model_optim_rng.pt", state)


def _steps_host_syncs(flags: str) -> int:
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 4 {flags}"), world_size=1)
    run = run_config_from_args(args, 97)
    mesh = single_process_mesh(torch.device("cpu"))
    model = build_model(run, mesh)
    optimizer = build_optimizer(model, run.optim, mesh=mesh)
    scheduler = LRScheduler(optimizer, run.optim, run.train.train_iters)
    data = iter(lambda: next(_micro_batches(1)), None)
    loop.train_step(run, mesh, model, optimizer, scheduler, data, 1)
    with HostSyncCounter() as counter:
        loop.train_step(run, mesh, model, optimizer, scheduler, data, 2)
    return counter.total


def test_loss_scaling_adds_no_host_sync_to_a_step():
    """The overflow flag is read with the gradient norm (Megatron reads it on its own)."""
    assert _steps_host_syncs("--fp16 --initial-loss-scale 4096") == _steps_host_syncs("--bf16")


def test_dry_run_counts_fp16_as_bf16():
    assert _dry_run_memory("--fp16", 1) == _dry_run_memory("--bf16", 1)
    assert _dry_run_memory("--fp16", 1)["weights"] * 2 == _dry_run_memory("", 1)["weights"]


@pytest.mark.parametrize("flags, says", [
    ("--loss-scale 1024", "--loss-scale needs --fp16, --bf16 or --use-distributed-optimizer"),
    ("--bf16 --hysteresis 3", "--hysteresis sets the dynamic loss scaler, which this run "
                              "does not have (it needs --fp16)"),
    ("--fp16 --loss-scale 8 --min-loss-scale 2", "--min-loss-scale sets the dynamic loss "
                                                 "scaler, which this run does not have "
                                                 "(--loss-scale gives a constant scale)"),
    ("--fp16 --bf16", "--fp16 and --bf16 are mutually exclusive"),
])
def test_flags_megatron_would_not_read_are_one_line(capsys, flags, says):
    """Megatron ignores these here; megamoe refuses them (docs/megatron-semantics.md)."""
    assert says in parse_error(capsys, f"{TINY_MOE} --train-iters 1 {flags}", 1)


def _agreeing_rank(rank: int, world_size: int, argv: str) -> tuple:
    """One DP rank: an Inf in one element of one gradient on rank 1 at iteration 2. That
    element's reduced slice lives on one rank only, so only the agreed found_inf makes the
    other rank skip too."""
    made: list = []
    build_opt, build = pretrain_module.build_optimizer, pretrain_module.build_model
    active = {"step": 0}

    def building(run, mesh=None):
        model = build(run, mesh)
        if rank == 1:
            w = next(p for n, p in model.named_parameters() if "output_layer" in n)
            w.register_hook(lambda g: g.index_fill(0, torch.tensor([5]), float("inf"))
                            if active["step"] == 2 else g)
        return model

    def building_opt(*a, **k):
        made.append(build_opt(*a, **k))
        return made[-1]

    counted: Callable = loop.forward_backward

    def fb(*a, **k):
        if not k.get("forward_only"):
            active["step"] += 1
        return counted(*a, **k)

    pretrain_module.build_model, pretrain_module.build_optimizer = building, building_opt
    loop.forward_backward = fb
    state = pretrain(parse_args(shlex.split(argv), world_size=world_size),
                     print_fn=lambda _m: None)
    weights = torch.cat([p.detach().float().flatten() for p in made[0].model_params])
    return state.skipped_iters, made[0].grad_scaler.state_dict(), weights


@pytest.mark.slow
def test_data_parallel_ranks_agree_on_an_overflow():
    """DP2, --use-distributed-optimizer: both ranks skip iteration 2, back off alike and
    end with the same weights."""
    from tests.distributed import run_distributed

    out = run_distributed(_agreeing_rank, 2, 180,
                          f"{TINY_MOE} --train-iters 3 --fp16 --initial-loss-scale 4096 "
                          "--hysteresis 1 --use-distributed-optimizer")
    (skipped0, scaler0, w0), (skipped1, scaler1, w1) = out
    assert skipped0 == skipped1 == 1
    assert scaler0 == scaler1 and scaler0["scale"] == 2048.0
    assert torch.equal(w0, w1)


def _history_rank(rank: int, world_size: int, argv: str) -> list:
    state = pretrain(parse_args(shlex.split(argv), world_size=world_size),
                     print_fn=lambda _m: None)
    return [(h["lm loss"], h["grad norm"]) for h in state.history]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    "--pipeline-model-parallel-size 2",
    "--tensor-model-parallel-size 2 --sequence-parallel",
    "--expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce",
])
def test_fp16_layouts_follow_the_single_process(layout):
    """fp16 under PP (scaled gradients sent between stages), TP+SP and EP with the
    distributed optimizer and overlapped reduction: losses within 1e-4 and grad norms
    within 0.1% of one process (measured: <= 1e-5 and 3e-5; fp16 roundings of sums
    split and ordered differently)."""
    from tests.distributed import run_distributed

    base = f"{TINY_MOE} --train-iters 4 --fp16 --initial-loss-scale 4096"
    single = _history_rank(0, 1, base)
    for loss_norm in run_distributed(_history_rank, 2, 300, f"{base} {layout}"):
        for (loss, norm), (ref_loss, ref_norm) in zip(loss_norm, single):
            assert abs(loss - ref_loss) < 1e-4 and abs(norm - ref_norm) < 1e-3 * ref_norm


@pytest.fixture(scope="module")
def fp16_checkpoints(tmp_path_factory):
    """One-iteration --fp16 checkpoints in both formats (their optimizer holds a scaler)."""
    root = tmp_path_factory.mktemp("fp16_fuzz")
    out = {}
    for fmt, name in (("torch", "model_optim_rng.pt"), ("torch_dist", "common.pt")):
        out[fmt] = (str(root / fmt), name)
        pretrain(parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 --fp16 --save "
                                        f"{root / fmt} --ckpt-format {fmt}"), world_size=1),
                 print_fn=lambda _m: None)
    return out


def _scaler_cases(state: dict, n: int, seed: int) -> list:
    from tests.training.test_checkpoint_fuzz import DELETE, REPLACEMENTS, _leaves

    assert state["optimizer"]["grad_scaler"]["scale"] == 2.0**32
    scaler = ("optimizer", "grad_scaler")
    paths = [scaler, *_leaves(state["optimizer"]["grad_scaler"], scaler)]
    cases = [(p, r) for p in paths for r in REPLACEMENTS + [DELETE]]
    return cases if n >= len(cases) else random.Random(seed).sample(cases, n)


def _fuzz_scaler(fp16_checkpoints, tmp_path, capsys, n: int, seed: int) -> None:
    """Each case: one grad_scaler field of the checkpoint replaced (a wrong type, out of
    range, deleted); `--fp16 --load` resumes or stops in one line with exit 1."""
    from megamoe.cli.main import main
    from tests.training.test_checkpoint_fuzz import _replaced

    failures = []
    for fmt, (saved, name) in fp16_checkpoints.items():
        target = os.path.join(saved, "iter_0000001", name)
        state = torch.load(target, map_location="cpu", weights_only=False)  # our own file
        for path, value in _scaler_cases(state, n, seed):
            root = str(tmp_path / "ckpt")
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(saved, root)
            torch.save(_replaced(state, path, value),
                       os.path.join(root, "iter_0000001", name))
            capsys.readouterr()
            case = f"{fmt} {path} <- {type(value).__name__}"
            try:
                code = main(shlex.split(f"{TINY_MOE} --train-iters 2 --fp16 --load {root}"))
            except BaseException as e:  # noqa: BLE001 (what the fuzz looks for)
                failures.append(f"{case}: {type(e).__name__}: {e}")
                continue
            err = capsys.readouterr().err
            lines = [ln for ln in err.splitlines() if ln.strip()]
            if code not in (0, 1) or (code == 1 and (len(lines) != 1 or "Traceback" in err)):
                failures.append(f"{case}: exit {code}: {err[-300:]}")
    assert not failures, f"{len(failures)} cases:\n" + "\n".join(failures)


def test_fuzzed_scaler_fields_resume_or_stop_in_one_line(fp16_checkpoints, tmp_path, capsys):
    _fuzz_scaler(fp16_checkpoints, tmp_path, capsys, n=3, seed=20261126)


@pytest.mark.slow
def test_every_scaler_field_fuzzed(fp16_checkpoints, tmp_path, capsys):
    _fuzz_scaler(fp16_checkpoints, tmp_path, capsys, n=10**9, seed=0)
