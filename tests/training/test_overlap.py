"""--overlap-grad-reduce / --ddp-bucket-size / --overlap-param-gather: every layout trains
to the losses and grad norms of the same layout without overlap (fp32, rel <= 1e-5, two
micro-batches per rank and step, several buckets); the flags' rules stop in one line.
The timing evidence (buckets launched during the backward, gathers waited during the
forward) is in tests/parallel/test_overlap_timing.py."""

from __future__ import annotations

import shlex

import pytest
import torch

import megamoe.training.pretrain as pretrain_module
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.cli.mapping import run_config_from_args
from megamoe.moe.losses import MoELossTracker
from megamoe.parallel.mesh import single_process_mesh
from megamoe.training.build import build_model
from megamoe.training.loop import train_step
from megamoe.training.optim import build_optimizer
from megamoe.training.optim.overlap import OverlapOptions
from megamoe.training.schedules.lr import LRScheduler
from tests.distributed import run_distributed
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

EXTRA = "--clip-grad 0.05"
KEYS = ("lm loss", "load_balancing_loss", "z_loss", "grad norm")
# a few thousand elements: the tiny MoE's dense and expert parameters fill several buckets
OVERLAP = "--overlap-grad-reduce --ddp-bucket-size 3000"


def _history(args: str, world_size: int, base: str) -> list[dict]:
    MoELossTracker.clear()
    parsed = parse_args(shlex.split(f"{base} {EXTRA} {args}"), world_size=world_size)
    return pretrain(parsed, print_fn=lambda _m: None).history


def _worker(rank: int, world_size: int, extra: str, overlap: str, base: str
            ) -> tuple[list, list]:
    """The layout without, then with overlap, in the same process group (the first run
    leaves it up for the second)."""
    extra = f"--train-iters 3 {extra}"
    original = pretrain_module.destroy_mesh
    pretrain_module.destroy_mesh = lambda _mesh: None
    try:
        plain = _history(extra, world_size, base)
    finally:
        pretrain_module.destroy_mesh = original
    built = []
    original_build = pretrain_module.build_optimizer

    def spy(*args, **kwargs):
        built.append(original_build(*args, **kwargs))
        built[-1].grad_sync.events = []
        return built[-1]

    pretrain_module.build_optimizer = spy
    try:
        overlapped = _history(f"{extra} {overlap}", world_size, base)
    finally:
        pretrain_module.build_optimizer = original_build
    kinds = [kind for kind, _b, _t in built[0].grad_sync.events]
    # every bucket of every step launched from the backward (the schedule said which
    # micro-batch was the last), none left for the step to launch
    assert kinds.count("launch") == 3 * len(built[0].grad_sync.buckets), kinds
    assert "late_launch" not in kinds
    return plain, overlapped


def _check(extra: str, world_size: int, overlap: str = OVERLAP,
           keys: tuple[str, ...] = KEYS, base: str = TINY_MOE) -> None:
    for rank, (plain, overlapped) in enumerate(run_distributed(_worker, world_size, 300,
                                                               extra, overlap, base)):
        assert len(plain) == len(overlapped) == 3
        for a, b in zip(plain, overlapped):
            for k in keys:
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (rank, k, plain, overlapped)


def test_dp2_overlap_grad_reduce_matches_no_overlap():
    _check("", 2)


@pytest.mark.slow
def test_dp2_distributed_optimizer_overlap_param_gather_matches():
    _check("--use-distributed-optimizer", 2, f"{OVERLAP} --overlap-param-gather")


@pytest.mark.slow
def test_ep2_x_dp2_distributed_optimizer_overlap_matches():
    _check("--use-distributed-optimizer --expert-model-parallel-size 2 "
           "--moe-token-dispatcher-type alltoall", 4, f"{OVERLAP} --overlap-param-gather")


@pytest.mark.slow
def test_ep2_x_dp2_overlap_grad_reduce_matches():
    _check("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall", 4)


@pytest.mark.slow
@pytest.mark.parametrize("dist_opt", ["", "--use-distributed-optimizer"])
def test_tp2_sp_x_dp2_overlap_matches(dist_opt):
    gather = " --overlap-param-gather" if dist_opt else ""
    _check(f"--tensor-model-parallel-size 2 --sequence-parallel {dist_opt}", 4,
           OVERLAP + gather)


@pytest.mark.slow
@pytest.mark.parametrize("dist_opt", ["", "--use-distributed-optimizer"])
def test_pp2_x_dp2_tied_embeddings_overlap_matches(dist_opt):
    # tied embedding on both stages: its gradient summed over the embedding group after
    # the data-parallel reduction (with the distributed optimizer: its own bucket)
    gather = " --overlap-param-gather" if dist_opt else ""
    tied = TINY_MOE.replace("--untie-embeddings-and-output-weights", "")
    _check(f"--pipeline-model-parallel-size 2 {dist_opt}", 4, OVERLAP + gather, base=tied)


@pytest.mark.slow
def test_pp2_interleaved_x_dp2_overlap_matches():
    _check("--num-layers 4 --pipeline-model-parallel-size 2 "
           "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 16", 4)


@pytest.mark.slow
def test_dp2_balancing_losses_and_expert_bias_overlap_matches():
    """seq aux loss + z-loss, aux-loss-free expert bias (sigmoid router), capacity drops."""
    _check("--moe-router-load-balancing-type seq_aux_loss --moe-router-score-function "
           "sigmoid --moe-router-enable-expert-bias --moe-expert-capacity-factor 1.5", 2,
           keys=("lm loss", "seq_load_balancing_loss", "z_loss", "grad norm"))


@pytest.mark.parametrize("flags, message", [
    ("--overlap-param-gather --overlap-grad-reduce",
     "--overlap-param-gather needs --use-distributed-optimizer"),
    ("--overlap-param-gather --use-distributed-optimizer",
     "--overlap-param-gather needs --overlap-grad-reduce"),
    ("--overlap-grad-reduce --ddp-bucket-size 0", "--ddp-bucket-size must be positive"),
    ("--ddp-bucket-size 1000", "--ddp-bucket-size needs --overlap-grad-reduce"),
])
def test_overlap_flag_rules_are_one_line(capsys, flags, message):
    assert message in parse_error(capsys, f"{TINY_MOE} --train-iters 1 {flags}", 2)


def _resume_worker(rank: int, world_size: int, root: str) -> dict[str, list[float]]:
    """A straight run; checkpoints at iteration 2 saved with overlap and resumed without,
    and the other way round (one process group for all five runs)."""
    dist_opt = "--use-distributed-optimizer --train-iters 4"
    overlap = f"{OVERLAP} --overlap-param-gather"
    runs = {"straight": dist_opt,
            "save_on": f"{dist_opt} {overlap} --exit-interval 2 --save {root}/on "
                       "--save-interval 2",
            "resume_off": f"{dist_opt} --load {root}/on",
            "save_off": f"{dist_opt} --exit-interval 2 --save {root}/off --save-interval 2",
            "resume_on": f"{dist_opt} {overlap} --load {root}/off"}
    original = pretrain_module.destroy_mesh
    pretrain_module.destroy_mesh = lambda _mesh: None
    try:
        return {name: [h["lm loss"] for h in _history(flags, world_size, TINY_MOE)]
                for name, flags in runs.items()}
    finally:
        pretrain_module.destroy_mesh = original


@pytest.mark.slow
def test_checkpoints_load_across_overlap_on_and_off(tmp_path):
    """torch_dist checkpoints are per parameter: the distributed optimizer's per-bucket
    shards (overlap) and whole-buffer shards (no overlap) load into each other."""
    for runs in run_distributed(_resume_worker, 2, 300, str(tmp_path)):
        straight = runs["straight"]
        assert len(straight) == 4
        for name in ("resume_off", "resume_on"):
            assert len(runs[name]) == 2
            for a, b in zip(straight[2:], runs[name]):
                assert abs(a - b) <= 1e-5 * abs(a), (name, runs)


@pytest.mark.parametrize("precision", [
    "", "--bf16", "--bf16 --use-distributed-optimizer --use-precision-aware-optimizer "
                  "--exp-avg-dtype fp16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16"],
    ids=["fp32", "bf16", "bf16-precision-aware"])
def test_overlap_adds_no_host_sync_and_keeps_the_single_process_step(precision):
    """One process (buckets without collectives): the same losses and grad norms as
    without overlap (bf16: fp32 main gradients in the buckets; --main-grads-dtype bf16:
    bf16 ones) and no extra host sync."""
    from tests.moe.test_host_syncs import HostSyncCounter
    from tests.training.test_nan_check import _batches

    results = {}
    for overlap in (None, OverlapOptions(3000)):
        args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 4 {precision}"),
                          world_size=1)
        run = run_config_from_args(args, 97)
        mesh = single_process_mesh(torch.device("cpu"))
        model = build_model(run, mesh)
        opt = build_optimizer(model, run.optim, mesh=mesh, overlap=overlap)
        assert (opt.grad_sync is None) == (overlap is None)
        scheduler = LRScheduler(opt, run.optim, run.train.train_iters)
        data = _batches(0)
        history = [train_step(run, mesh, model, opt, scheduler, data, 1)]
        with HostSyncCounter() as counter:
            history.append(train_step(run, mesh, model, opt, scheduler, data, 2))
        results[overlap is None] = (history, counter.total)
    (plain, syncs_plain), (overlapped, syncs) = results[True], results[False]
    assert syncs == syncs_plain
    for a, b in zip(plain, overlapped):
        for k in KEYS:
            assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (k, plain, overlapped)
