"""pretrain_gpt.py-level parity for expert parallelism: EP (x DP, x TP+SP, x PP) layouts,
both token dispatchers, train the tiny MoE config to the single-process losses and weights;
after training every expert's weights are identical across its edp replicas, different
experts differ, and dense weights are identical across dp. Bad EP layouts stop in one line."""

from __future__ import annotations

import shlex
import time

import pytest
import torch

import megamoe.training.pretrain as pretrain_module
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.moe.losses import MoELossTracker
from tests.distributed import run_distributed
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

EXTRA = "--train-iters 5 --clip-grad 0.05 --eval-interval 5 --eval-iters 1"
KEYS = ("lm loss", "load_balancing_loss", "z_loss", "grad norm")
EXPERT_KEYS = ("experts.fc1_weight", "experts.fc2_weight")


def _train(extra: str, world_size: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Losses and the final weights of this rank's model."""
    MoELossTracker.clear()  # an earlier in-process test may have left unread MoE losses
    built = []
    original = pretrain_module.build_model

    def spy(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    pretrain_module.build_model = spy
    try:
        args = parse_args(shlex.split(f"{TINY_MOE} {EXTRA} {extra}"), world_size=world_size)
        history = pretrain(args, print_fn=lambda _msg: None).history
    finally:
        pretrain_module.build_model = original
    weights = {k: v.detach().clone() for k, v in built[0].state_dict().items()
               if v.is_floating_point()}
    return history, weights


def _worker(rank: int, world_size: int, extra: str):
    history, weights = _train(extra, world_size)
    # numpy arrays travel by value (tensors would go through shared memory that dies with
    # the child process).
    return history, {k: v.numpy() for k, v in weights.items()}


_SINGLE: dict[str, tuple[list[dict], dict[str, torch.Tensor]]] = {}


def _single(extra: str = ""):
    if extra not in _SINGLE:
        _SINGLE[extra] = _train(extra, 1)
    return _SINGLE[extra]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max())


def _check(per_rank, ep: int, edp_of, extra_single: str = "") -> None:
    """Losses equal single-process; every rank's expert slice equals the single-process
    experts after training (so replicas agree and experts stay distinct); dense weights
    equal single-process on every rank."""
    single_hist, single_w = _single(extra_single)
    assert all(h["grad norm"] > 0.05 for h in single_hist)  # clipping is active
    num_experts = 4
    local = num_experts // ep
    for rank, (hist, weights) in enumerate(per_rank):
        assert len(hist) == len(single_hist) == 5
        for a, b in zip(single_hist, hist):
            for k in KEYS:
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (rank, k, single_hist, hist)
        valid = single_hist[-1]["valid lm loss"]  # evaluation (no grad) under the layout
        assert abs(hist[-1]["valid lm loss"] - valid) <= 1e-5 * valid
        ep_rank = edp_of(rank)
        for name, w in weights.items():
            ref = single_w[name]
            if name.endswith(EXPERT_KEYS):
                assert w.shape[0] == local
                ref = ref[ep_rank * local:(ep_rank + 1) * local]
            assert w.shape == ref.shape, name
            assert _close(w, ref), (rank, name)
    # Different experts stay different (the check above would also pass for a broadcast).
    w0 = per_rank[0][1]
    name = next(n for n in w0 if n.endswith("experts.fc1_weight"))
    full = single_w[name]
    assert not torch.allclose(full[0], full[-1])


def _check_losses(per_rank) -> None:
    """Every given rank's losses and grad norms equal the single-process run's (rel 1e-5);
    for layouts whose expert weights are not whole per rank (ETP) or not on every rank."""
    single_hist, _ = _single()
    for hist, _weights in per_rank:
        assert len(hist) == len(single_hist)
        for a, b in zip(single_hist, hist):
            for k in KEYS:
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (k, single_hist, hist)


def _run(extra: str, world: int, timeout: float = 300):
    start = time.time()
    out = [(hist, {k: torch.from_numpy(v) for k, v in w.items()})
           for hist, w in run_distributed(_worker, world, timeout, extra)]
    print(f"{extra} (world {world}): {time.time() - start:.1f} s")
    return out


@pytest.mark.parametrize("dispatcher, overlap", [
    ("alltoall", 1), pytest.param("allgather", 1, marks=pytest.mark.slow),
    pytest.param("alltoall", 2, marks=pytest.mark.slow)])
def test_ep2_matches_single_process(dispatcher, overlap):
    per_rank = _run(f"--expert-model-parallel-size 2 --moe-token-dispatcher-type {dispatcher} "
                    f"--moe-a2a-overlap-degree {overlap}", 2)
    _check(per_rank, 2, lambda r: r)


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_x_dp2_matches_single_process(dispatcher):
    # world 4: ep rank = rank % 2, edp rank = rank // 2; 2 experts per rank.
    per_rank = _run(f"--expert-model-parallel-size 2 --moe-token-dispatcher-type {dispatcher}",
                    4)
    _check(per_rank, 2, lambda r: r % 2)


@pytest.mark.slow
def test_ep4_matches_single_process():
    per_rank = _run("--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall", 4)
    _check(per_rank, 4, lambda r: r)


@pytest.mark.slow
@pytest.mark.parametrize("etp", [2, 1])
def test_ep2_x_tp2_sp_matches_single_process(etp):
    # ETP = 2: experts split over F between the TP ranks (which feed the same, gathered
    # tokens), ep rank = (rank // 2) % 2, edp size 1. ETP = 1: whole experts, each TP rank
    # sends its own sequence shard; ep rank = rank % 2, edp = the dp x tp replicas.
    per_rank = _run("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
                    "--tensor-model-parallel-size 2 --sequence-parallel "
                    f"--expert-tensor-parallel-size {etp}", 4)
    _check_losses(per_rank)


@pytest.mark.slow
def test_ep2_x_pp2_matches_single_process():
    per_rank = _run("--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather "
                    "--pipeline-model-parallel-size 2", 4)
    # Only the last stage holds the loss and the whole-model grad norm is the same everywhere.
    _check_losses(per_rank[2:])


def _fails(capsys, extra: str, world_size: int) -> str:
    return parse_error(capsys, f"{TINY_MOE} --train-iters 1 {extra}", world_size)


@pytest.mark.parametrize("extra, world, message", [
    ("--expert-model-parallel-size 3 --global-batch-size 6", 3,
     "--num-experts (4) must be divisible by --expert-model-parallel-size (3)"),
    ("--expert-model-parallel-size 4", 2,
     "world size 2 is not divisible by --expert-tensor-parallel-size (1) x "
     "--expert-model-parallel-size (4) x --pipeline-model-parallel-size (1)"),
    ("--expert-model-parallel-size 2 --pipeline-model-parallel-size 2", 2,
     "world size 2 is not divisible by --expert-tensor-parallel-size (1) x "
     "--expert-model-parallel-size (2) x --pipeline-model-parallel-size (2)"),
    ("--expert-model-parallel-size 2 --moe-a2a-overlap-degree 2", 2,
     "--moe-a2a-overlap-degree > 1 needs --moe-token-dispatcher-type alltoall and "
     "--expert-model-parallel-size > 1"),
    ("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
     "--moe-a2a-overlap-degree 0", 2, "--moe-a2a-overlap-degree must be >= 1, got 0"),
    ("--expert-model-parallel-size 2 --save /tmp/x --ckpt-format torch", 2,
     "--ckpt-format torch (single file) cannot save with --expert-model-parallel-size > 1"),
    ("--expert-model-parallel-size 2 --moe-expert-capacity-factor 1.0 "
     "--moe-pad-expert-input-to-capacity", 2,
     "not supported yet: --moe-pad-expert-input-to-capacity with "
     "--expert-model-parallel-size > 1"),
])
def test_bad_expert_parallel_layouts_fail_in_one_line(capsys, extra, world, message):
    assert message in _fails(capsys, extra, world)
