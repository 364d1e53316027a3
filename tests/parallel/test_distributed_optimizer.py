"""--use-distributed-optimizer: DP=2 and EP=2 x DP=2 train to the single-process losses and
weights (fp32, 5 iterations, clipping active); per-rank optimizer memory shrinks ~1 / DP;
a bf16 model keeps fp32 main slices; the layout flags stop in one line."""

from __future__ import annotations

import shlex

import pytest
import torch
import torch.distributed as dist

from megamoe.cli.arguments import parse_args
from megamoe.config import OptimizerConfig
from megamoe.training.optim.distributed import DistributedOptimizer
from megamoe.training.optim.mixed_precision import MixedPrecisionOptimizer
from tests.distributed import run_distributed
from tests.training.test_pretrain import TINY_MOE
from tests.training.test_pretrain_expert_parallel import _check, _check_losses, _run


def test_dp2_distributed_optimizer_matches_single_process():
    _check(_run("--use-distributed-optimizer", 2), 1, lambda r: 0)


@pytest.mark.slow
def test_ep2_x_dp2_distributed_optimizer_matches_single_process():
    per_rank = _run("--use-distributed-optimizer --expert-model-parallel-size 2 "
                    "--moe-token-dispatcher-type alltoall", 4)
    _check(per_rank, 2, lambda r: r % 2)


@pytest.mark.slow
@pytest.mark.parametrize("etp", [2, 1])
def test_ep2_x_tp2_sp_distributed_optimizer_matches_single_process(etp):
    # Dense shards over dp = 2; experts split over F (ETP 2, edp 1) or whole with the
    # edp = 2 replicas sharding their states (ETP 1): the grad norm counts each once.
    per_rank = _run("--use-distributed-optimizer --expert-model-parallel-size 2 "
                    "--moe-token-dispatcher-type alltoall --tensor-model-parallel-size 2 "
                    f"--sequence-parallel --expert-tensor-parallel-size {etp}", 4)
    _check_losses(per_rank)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96),
                               torch.nn.Linear(96, 33))


def _memory_and_step_worker(rank: int, world: int) -> dict:
    """Optimizer bytes per rank, and one step on rank-specific data equals the plain
    optimizer on the mean gradient (what a single process computes)."""
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5)
    model, ref = _model(), _model()
    group = dist.group.WORLD if world > 1 else None
    opt = DistributedOptimizer(model, cfg, tp_group=None, dp_group=group)
    plain = MixedPrecisionOptimizer(ref, cfg)
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(world, 5, 64, generator=g)
    for _ in range(2):
        opt.zero_grad()
        plain.zero_grad()
        model(xs[rank]).square().mean().div(1).backward()
        for r in range(world):  # the plain optimizer sees the whole batch's mean gradient
            ref(xs[r]).square().mean().div(world).backward()
        ok, norm, _ = opt.step()
        ok_ref, norm_ref, _ = plain.step()
        assert ok and ok_ref and abs(norm - norm_ref) <= 1e-5 * norm_ref
    # Adam divides each element by its own gradient scale: where the gradient nearly
    # cancels, the fp32 summation-order difference (a reduce-scatter of two ranks' sums vs
    # one backward) reaches the update at a size of up to ~1e-4 x lr.
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-4 * cfg.lr)
    return {"bytes": opt.state_bytes(), "numel": sum(p.numel() for p in model.parameters())}


@pytest.mark.slow  # (default-set budget: a representative case stays)
def test_optimizer_memory_shrinks_with_dp():
    """Measured for the report: Adam states per rank for DP = 1, 2, 4 (fp32: the main
    slices are views of the parameters' own shard, no copy)."""
    single = _memory_and_step_worker(0, 1)
    two = run_distributed(_memory_and_step_worker, 2, 90)
    numel = single["numel"]
    assert single["bytes"] == 2 * 4 * numel  # exp_avg + exp_avg_sq, fp32
    for r in two:
        assert abs(r["bytes"] - single["bytes"] / 2) <= 2 * 4 * 2  # padding of one element
    print(f"optimizer bytes per rank: DP=1 {single['bytes']}, "
          f"DP=2 {[r['bytes'] for r in two]}")


@pytest.mark.slow
def test_optimizer_memory_dp4():
    four = run_distributed(_memory_and_step_worker, 4, 120)
    single = _memory_and_step_worker(0, 1)
    for r in four:
        assert abs(r["bytes"] - single["bytes"] / 4) <= 2 * 4 * 4
    print(f"optimizer bytes per rank: DP=4 {[r['bytes'] for r in four]}")


def test_bf16_model_keeps_fp32_main_slices():
    model = _model().to(torch.bfloat16)
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2), tp_group=None, dp_group=None)
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean().backward()
    assert all(p.grad is None for p in model.parameters())  # moved to fp32 buffers
    ok, _, _ = opt.step()
    assert ok
    mains = [piece.main for buf in opt.buffers for piece in buf.pieces]
    assert all(m.dtype == torch.float32 for m in mains)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    flat = torch.cat([p.detach().float().reshape(-1) for p in opt.model_params])
    assert torch.equal(flat, torch.cat(mains).bfloat16().float())


def test_single_file_save_with_distributed_optimizer_and_dp_fails_in_one_line(capsys):
    """One file holds rank 0's tensors: not the dp shards (torch_dist saves them)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 --use-distributed-optimizer "
                               f"--save /tmp/x --ckpt-format torch"), world_size=2)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert ("--ckpt-format torch (single file) cannot save with --use-distributed-optimizer "
            "and data-parallel size > 1") in err
