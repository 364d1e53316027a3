"""Megatron-LM's run-health flags (cli/runhealth_args.py):
--check-weight-hash-across-dp-replicas-interval (training/weight_hash.py),
--check-for-spiky-loss (training/spiky_loss.py) and --rerun-mode, whose only built value,
`disabled`, is megamoe's default (Megatron's is validate_results: a named difference).
"""

from __future__ import annotations

import contextlib
import io
import logging
import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import main, pretrain
from megamoe.training import loop, spiky_loss
from megamoe.training.loop import train_step
from megamoe.training.spiky_loss import SpikyLossCheck
from megamoe.training.weight_hash import param_hash
from tests.distributed import run_distributed
from tests.moe.test_host_syncs import HostSyncCounter
from tests.training.test_nan_check import _batches, _components, _one_line
from tests.training.test_pretrain import TINY_MOE

HASH = "--check-weight-hash-across-dp-replicas-interval"


# --- the parameter hash -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_param_hash_changes_with_any_one_bit_and_with_order(dtype):
    """The lowest bit of one element flipped (1 ulp) anywhere, two elements swapped, or a
    3-byte tensor reordered: the hash differs; the same bytes elsewhere hash the same."""
    g = torch.Generator().manual_seed(0)  # host test data
    p = torch.randn(257, 3, generator=g).to(dtype)
    h = param_hash(p)
    assert torch.equal(h, param_hash(p.clone()))
    word = torch.int32 if dtype == torch.float32 else torch.int16
    for k in (0, 1, 100, p.numel() - 1):
        q = p.clone()
        q.view(-1).view(word)[k] ^= 1
        assert not torch.equal(param_hash(q), h), k
    swapped = p.clone().view(-1)
    swapped[[3, 4]] = swapped[[4, 3]].clone()
    assert not torch.equal(swapped[3], swapped[4])
    assert not torch.equal(param_hash(swapped), h)
    odd = torch.arange(3, dtype=torch.uint8)  # 3 bytes: widened, not viewed as words
    assert not torch.equal(param_hash(odd), param_hash(odd.flip(0)))


# --- the DP2 comparison (gloo) ------------------------------------------------------------

def _corrupting_rank(rank: int, world_size: int, argv: str, step: int, bad_rank: int,
                     which: str) -> tuple[int, str, str]:
    """pretrain_gpt.py's main on one rank; after training step `step` on `bad_rank`, one
    element of the first dense ("dense") or routed-expert ("expert") parameter moves by
    one ulp. (exit code, stderr, stdout)."""
    step_fn = loop.train_step
    calls = {"n": 0}

    def corrupting(run, mesh, model, *args, **kwargs):
        out = step_fn(run, mesh, model, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == step and rank == bad_rank:
            p = next(p for _, p in model.named_parameters()
                     if getattr(p, "expert_parallel", False) == (which == "expert"))
            with torch.no_grad():
                flat = p.view(-1)
                flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
        return out

    loop.train_step = corrupting
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(shlex.split(argv))
    return code, err.getvalue(), out.getvalue()


@pytest.mark.parametrize("which, group", [
    ("dense", "data-parallel"),
    pytest.param("expert", "expert-data-parallel", marks=pytest.mark.slow),
])
def test_dp2_replicas_match_then_a_corrupted_replica_stops_the_run(which, group):
    """DP2 on gloo: the hashes match at the start and after iteration 1; one ulp of one
    parameter moved on rank 1 after step 2 stops both ranks at iteration 2 with one line
    naming the iteration, the parameter and the rank."""
    argv = f"{TINY_MOE} --train-iters 3 {HASH} 1"
    results = run_distributed(_corrupting_rank, 2, 240, argv, 2, 1, which)
    for code, err, _out in results:
        line = _one_line(code, err, ["iteration 2: parameter hashes not matching across DP "
                                     "replicas", f"differs on {group} rank 1 (global rank 1)",
                                     f"from {group} rank 0"])
        assert ("experts" in line) == (which == "expert"), line
    out = results[1][2]  # the logging rank
    assert ">>> Weight hashes match after 0 iterations..." in out
    assert ">>> Weight hashes match after 1 iterations..." in out
    assert "after 2 iterations" not in out


# --- spiky loss ---------------------------------------------------------------------------

def _megatron_rule(values: list[float]) -> list[bool]:
    """RerunStateMachine.is_unexpectedly_large(threshold=10, num_samples=100), written
    out as Megatron's code reads (the reference)."""
    count, top, out = 0, 0.0, []
    for v in values:
        v = abs(v)
        if v != v or v in (float("inf"),):
            out.append(False)
            continue
        if count < 100:
            count, top = count + 1, max(top, v)
            out.append(False)
            continue
        out.append(v >= top * 10)
    return out


def test_spiky_rule_is_megatrons():
    """The first 100 finite values fix the reference (their largest magnitude, never
    updated after); NaN/Inf are ignored, not counted; >= 10x is spiky (== too)."""
    values = [3.0, float("nan"), -7.0, float("inf")] + [5.0] * 98 + \
        [69.9, 70.0, -70.0, 1e9, float("nan"), 71.0, 1.0]
    check = SpikyLossCheck(0, torch.device("cpu"))
    got = [check.is_spiky(v) for v in values]
    assert got == _megatron_rule(values)
    assert got[-7:] == [False, True, True, True, False, True, False]


class _Spike:
    """loop.forward_backward with step `step`'s final-norm output x 1000 (logits x 1000:
    every micro-batch's loss is spiky); the reference is one step's 4 micro-batches."""

    def __init__(self, step: int) -> None:
        self.step, self.calls, self.inner = step, 0, loop.forward_backward

    def __call__(self, model, data_iter, n, *, forward_only=False, **kwargs):
        if forward_only:
            return self.inner(model, data_iter, n, forward_only=True, **kwargs)
        self.calls += 1
        hooks = [m.register_forward_hook(lambda m, a, out: out * 1000.0)
                 for name, m in model.named_modules()
                 if name.endswith("final_layernorm") and self.calls == self.step]
        try:
            return self.inner(model, data_iter, n, **kwargs)
        finally:
            for h in hooks:
                h.remove()


def test_spiky_loss_warns_on_the_spiky_step_and_trains_on(monkeypatch, caplog):
    """End to end (pretrain): with the reference taken over step 1's 4 micro-batches
    (NUM_SAMPLES lowered from Megatron's 100 to keep the test short), step 3's logits x 1000
    make every micro-batch's local loss spiky: four warnings in Megatron's words for
    iteration 3, none for 2, and the run completes (the check is not fatal)."""
    monkeypatch.setattr(spiky_loss, "NUM_SAMPLES", 4)
    monkeypatch.setattr(loop, "forward_backward", _Spike(3))
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 4 --check-for-spiky-loss"),
                      world_size=1)
    with caplog.at_level(logging.WARNING, logger=spiky_loss.__name__):
        state = pretrain(args, print_fn=lambda _m: None)
    assert state.iteration == 4
    spikes = [r.getMessage() for r in caplog.records if "Spiky loss" in r.getMessage()]
    assert len(spikes) == 4, spikes
    assert all(s.startswith("Rank 0, node ") and ", iteration 3: Unexpected result " in s
               and s.endswith("(message='Spiky loss')") for s in spikes), spikes
    assert any(r.getMessage().startswith("Max value for loss: ") for r in caplog.records)


def _spiky_rank(rank: int, world_size: int, argv: str) -> tuple[int, list[str]]:
    """pretrain_gpt.py's main with step 3 spiky; (exit code, the spiky-loss warnings)."""
    spiky_loss.NUM_SAMPLES = 4
    loop.forward_backward = _Spike(3)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger(spiky_loss.__name__).addHandler(handler)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        code = main(shlex.split(argv))
    return code, [m for m in seen if "Spiky loss" in m]


@pytest.mark.slow
def test_spiky_loss_under_pipelining_is_the_last_stages():
    """PP2: the last stage (rank 1) holds the loss and warns for iteration 3's four
    micro-batches; the first stage records nothing (and reads nothing)."""
    argv = f"{TINY_MOE} --train-iters 4 --check-for-spiky-loss --pipeline-model-parallel-size 2"
    (code0, first), (code1, last) = run_distributed(_spiky_rank, 2, 240, argv)
    assert code0 == code1 == 0
    assert first == [] and len(last) == 4, (first, last)
    assert all(m.startswith("Rank 1, node ") and ", iteration 3: " in m for m in last), last


def test_spiky_values_are_the_local_micro_batch_token_sums():
    """What is checked is Megatron's loss_func value: each micro-batch's sum of token
    losses. Reference: their mean / tokens per micro-batch is the step's LM loss (full
    masks; fp32 sums in a different order: rel 1e-5)."""
    run, mesh, model, optimizer, scheduler = _components("")
    seen: list[float] = []

    class Recorder(SpikyLossCheck):
        def is_spiky(self, value: float) -> bool:
            seen.append(value)
            return super().is_spiky(value)

    metrics = train_step(run, mesh, model, optimizer, scheduler, _batches(0), 1,
                         spiky=Recorder(0, mesh.device))
    assert len(seen) == 4  # global batch 8 / micro-batch 2
    tokens = 2 * 16
    assert sum(seen) / len(seen) / tokens == pytest.approx(metrics["lm loss"], rel=1e-5)


def test_without_the_flag_no_micro_batch_loss_is_kept():
    """Off (the default), the schedules record nothing: no extra sum per micro-batch."""
    run, mesh, model, optimizer, scheduler = _components("")
    seen = []
    for name, m in model.named_modules():
        if name.endswith("final_layernorm"):
            m.register_forward_hook(lambda m, a, out: seen.append(spiky_loss.LocalLosses._values))
    train_step(run, mesh, model, optimizer, scheduler, _batches(0), 1)
    assert seen == [None] * 4


def test_the_spiky_check_adds_no_host_read_to_a_step():
    """On: the step's micro-batch losses are read with the optimizer's verdict, in its one
    read (Megatron: one read per micro-batch); the step's host reads are those without the
    check."""
    totals = {}
    for on in (False, True):
        run, mesh, model, optimizer, scheduler = _components("")
        data = _batches(0)
        spiky = SpikyLossCheck(0, mesh.device) if on else None
        train_step(run, mesh, model, optimizer, scheduler, data, 1, spiky=spiky)
        with HostSyncCounter() as counter:
            train_step(run, mesh, model, optimizer, scheduler, data, 2, spiky=spiky)
        totals[on] = counter.total
    assert totals[True] == totals[False], totals


# --- --rerun-mode and the refused flags ---------------------------------------------------

def test_rerun_mode_default_is_disabled_a_named_difference_from_megatron():
    """Megatron's default is validate_results (not built); megamoe's is disabled."""
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 1"), world_size=1)
    assert args.rerun_mode == "disabled"
    assert parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 --rerun-mode disabled"),
                      world_size=1).rerun_mode == "disabled"


@pytest.mark.parametrize("extra, says", [
    ("--rerun-mode validate_results", "not supported yet: --rerun-mode validate_results"),
    ("--rerun-mode report_stats", "not supported yet: --rerun-mode report_stats"),
    ("--error-injection-rate 10", "not supported yet: --error-injection-rate"),
    ("--error-injection-type persistent_error", "not supported yet: --error-injection-type"),
])
def test_unbuilt_rerun_machinery_is_refused_in_one_line(capsys, extra, says):
    with pytest.raises(SystemExit) as e:
        main(shlex.split(f"{TINY_MOE} --train-iters 1 {extra}"))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err


@pytest.mark.slow
def test_ranks_outside_the_diverged_replicas_stop_too():
    """TP2 x DP2: rank 3's shard moved, so only the dp group {1, 3} sees the difference;
    ranks 0 and 2 (whose replicas agree) stop as well, naming the rank that found it,
    rather than waiting in the next collective."""
    argv = (f"{TINY_MOE} --train-iters 3 {HASH} 1 --tensor-model-parallel-size 2 "
            "--sequence-parallel")
    results = run_distributed(_corrupting_rank, 4, 300, argv, 2, 3, "dense")
    head = "iteration 2: parameter hashes not matching across DP replicas"
    for rank, (code, err, _out) in enumerate(results):
        says = ("differs on data-parallel rank 1 (global rank 3) from data-parallel rank 0 "
                "(global rank 1)" if rank in (1, 3) else "found by global rank 1")
        _one_line(code, err, [head, says])


@pytest.mark.slow
def test_expert_parameters_compare_over_the_expert_data_parallel_group():
    """EP2 x DP4 (edp 2): each ep rank holds other experts, so comparing them over the
    dense dp group would fail at the start; over edp they match until rank 3's expert
    weight moves, which only its edp group {1, 3} can see."""
    argv = f"{TINY_MOE} --train-iters 3 {HASH} 1 --expert-model-parallel-size 2"
    results = run_distributed(_corrupting_rank, 4, 300, argv, 2, 3, "expert")
    head = "iteration 2: parameter hashes not matching across DP replicas"
    for rank, (code, err, _out) in enumerate(results):
        says = ("experts" if rank in (1, 3) else "found by global rank 1")
        line = _one_line(code, err, [head, says])
        if rank in (1, 3):
            assert "differs on expert-data-parallel rank 1 (global rank 3) from " \
                "expert-data-parallel rank 0 (global rank 1)" in line, line
    assert ">>> Weight hashes match after 1 iterations..." in results[3][2]
