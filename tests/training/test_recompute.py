"""Activation recompute trains exactly as the run without it: every mode, every layout
(single process; EP=2 alltoall; slow: TP=2+SP, PP=2, DP=2, EP=2 x DP=2 with the
distributed optimizer, TP=2+SP x EP=2), with aux, seq aux, global aux and z losses, the
aux-loss-free expert bias, dropout and router jitter on. The replayed forward counts
nothing twice: routing statistics, expert-bias counts, global-aux running counts and the
logged losses are those of the run without recompute."""

from __future__ import annotations

import shlex

import pytest
import torch

import megamoe.parallel.checkpointing as checkpointing
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.cli.mapping import run_config_from_args
from megamoe.moe.layer import MoELayer
from megamoe.moe.losses import MoELossTracker
from megamoe.training.build import build_model
from megamoe.training.schedules import forward_backward
from tests.distributed import run_distributed
from tests.training.test_pretrain import TINY_MOE

EXTRA = ("--train-iters 3 --eval-interval 3 --eval-iters 1 --hidden-dropout 0.1 "
         "--attention-dropout 0.1 --moe-input-jitter-eps 0.01")
BALANCING = ("--moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss "
             "--moe-aux-loss-coeff 1e-2")
BIAS = "--moe-router-score-function sigmoid --moe-router-enable-expert-bias"
SHARED = "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate --moe-layer-freq 2"
SEL = "--recompute-granularity selective --recompute-modules"
MODES = {
    "core_attn": "--recompute-granularity selective",
    "moe": f"{SEL} moe",
    "moe_act+layernorm": f"{SEL} moe_act layernorm",
    "mlp+shared_experts": f"{SHARED} {SEL} mlp shared_experts",
    "full-uniform-1": "--recompute-granularity full --recompute-method uniform "
                      "--recompute-num-layers 1",
    "full-uniform-2": "--recompute-granularity full --recompute-method uniform "
                      "--recompute-num-layers 2",
    "full-block-1": "--recompute-granularity full --recompute-method block "
                    "--recompute-num-layers 1",
    "moe-layer-recompute": "--moe-layer-recompute",
}


def _history(extra: str, world_size: int = 1) -> list[dict]:
    MoELossTracker.clear()
    args = parse_args(shlex.split(f"{TINY_MOE} {EXTRA} {extra}"), world_size=world_size)
    return pretrain(args, print_fn=lambda _msg: None).history


def _both(extra: str, recompute: str, world_size: int = 1) -> tuple[list[dict], list[dict]]:
    """(without, with recompute); a dense-layer pattern / shared experts the mode needs go
    into both runs."""
    model_flags = SHARED if SHARED in recompute else ""
    return (_history(f"{extra} {model_flags}", world_size),
            _history(f"{extra} {recompute}", world_size))


def _assert_same(base: list[dict], got: list[dict], what: str = "") -> None:
    assert len(base) == len(got) == 3
    for a, b in zip(base, got):
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]) + 1e-12, (what, k, base, got)


def _worker(rank: int, world_size: int, extra: str):
    return _history(extra, world_size)


def _both_distributed(world: int, extra: str, recompute: str, timeout: float
                      ) -> list[tuple[list[dict], list[dict]]]:
    """Per rank (without, with recompute), each run in fresh processes: two process groups
    one after the other in one process can race (a fast rank reaching the second
    rendezvous while rank 0 still serves the first one's store)."""
    model_flags = SHARED if SHARED in recompute else ""
    base = run_distributed(_worker, world, timeout, f"{extra} {model_flags}")
    got = run_distributed(_worker, world, timeout, f"{extra} {recompute}")
    return list(zip(base, got))


@pytest.mark.parametrize("losses", ["balancing", "expert_bias"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_trains_as_without_recompute(mode, losses):
    extra = BALANCING if losses == "balancing" else f"{BIAS} --moe-aux-loss-coeff 0"
    base, got = _both(extra, MODES[mode])
    _assert_same(base, got, mode)


def _counters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, MoELayer)):
        r = layer.router
        for name, t in (("routed", layer.stat_routed_per_expert),
                        ("kept", layer.stat_kept_per_expert), ("tokens", layer.stat_num_tokens),
                        ("bias_counts", r.local_tokens_per_expert),
                        ("global_counts", r.global_tokens_per_expert),
                        ("global_tokens", r.global_num_tokens)):
            out[f"{i}.{name}"] = t.clone()
    return out


def _one_step(recompute: str, replays: list[int]):
    """Counters, logged losses and gradients after one global batch (2 micro-batches)."""
    flags = f"{TINY_MOE} --train-iters 1 {BALANCING} {BIAS} --hidden-dropout 0.1 {recompute}"
    run = run_config_from_args(parse_args(shlex.split(flags), world_size=1), 97)
    model = build_model(run)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 97, (2, 16), generator=g)
    batch = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(2, 16)}
    MoELossTracker.clear()
    torch.manual_seed(5)
    original = checkpointing.set_tracker_states

    def spy(states):
        replays.append(1)
        return original(states)

    checkpointing.set_tracker_states = spy
    try:
        forward_backward(model, iter([batch, batch]), 2)
    finally:
        checkpointing.set_tracker_states = original
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return _counters(model), MoELossTracker.report(2), grads


@pytest.mark.parametrize("recompute", [MODES["moe"], MODES["full-uniform-1"]])
def test_the_replay_counts_nothing_twice(recompute):
    """Routing statistics, expert-bias counts, global-aux running counts and the logged
    losses of a step with recompute equal those without; the replays did run."""
    replays: list[int] = []
    base = _one_step("", replays)
    assert replays == []
    got = _one_step(recompute, replays)
    assert len(replays) >= 2 * 2  # each micro-batch replays (set + restore per replay)
    for name, value in base[0].items():
        assert torch.equal(value, got[0][name]), name
    assert base[1].keys() == got[1].keys() and all(
        torch.equal(base[1][k], got[1][k]) for k in base[1])
    assert base[2].keys() == got[2].keys()
    for name, grad in base[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.slow  # (default-set budget: a representative case stays)
def test_expert_parallel_alltoall_replays_its_all_to_all():
    """EP=2, alltoall dispatcher: the MoE layer's recompute replays dispatch and combine on
    both ranks (the default set's multi-rank case)."""
    extra = (f"{BALANCING} --expert-model-parallel-size 2 --moe-token-dispatcher-type "
             "alltoall")
    for base, got in _both_distributed(2, extra, MODES["moe-layer-recompute"], 240):
        _assert_same(base, got, "ep2")


LAYOUTS = {
    "tp2_sp_full": (2, "--tensor-model-parallel-size 2 --sequence-parallel",
                    MODES["full-uniform-1"]),
    "tp2_sp_selective": (2, "--tensor-model-parallel-size 2 --sequence-parallel",
                         f"{SEL} core_attn moe moe_act layernorm"),
    "pp2_full_block": (2, "--pipeline-model-parallel-size 2", MODES["full-block-1"]),
    "pp2_selective": (2, "--pipeline-model-parallel-size 2", f"{SEL} moe layernorm"),
    "dp2_full": (2, "", MODES["full-uniform-2"]),
    "ep2_dp2_distopt": (4, f"{BIAS} --expert-model-parallel-size 2 --moe-token-dispatcher-type "
                           "alltoall --use-distributed-optimizer",
                        f"{SEL} moe moe_act layernorm"),
    "dp2_overlap_distopt_full": (2, "--use-distributed-optimizer --overlap-grad-reduce "
                                    "--overlap-param-gather --ddp-bucket-size 3000",
                                 MODES["full-uniform-1"]),
    "tp2_sp_ep2": (4, "--tensor-model-parallel-size 2 --sequence-parallel "
                      "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
                   MODES["moe"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_train_as_without_recompute(layout):
    world, extra, recompute = LAYOUTS[layout]
    for rank, (base, got) in enumerate(_both_distributed(world, f"{BALANCING} {extra}",
                                                         recompute, 600)):
        _assert_same(base, got, f"{layout} rank {rank}")
