"""pretrain_gpt.py-level parity for context parallelism: CP layouts (x EP, x TP+SP, x PP,
with the distributed optimizer), with and without document masking, train the tiny MoE
config to the single-process losses, grad norms and weights (fp32, rel <= 1e-5)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE
from tests.training.test_pretrain_expert_parallel import _train

# Every balancing loss and the z-loss at once: under CP each counts every token of the
# sequence once (aux_loss / seq_aux_loss sum their counts over cp, global_aux_loss over
# dp x cp), so values and gradients equal one process's.
CP_BASE = ("--moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss "
           "--moe-aux-loss-coeff 1e-2 3e-2 1e-2 --moe-z-loss-coeff 1e-3 "
           "--train-iters 4 --clip-grad 0.05 --eval-interval 4 --eval-iters 1")
DOCS = "--reset-attention-mask --reset-position-ids --eod-mask-loss"
KEYS = ("lm loss", "grad norm", "load_balancing_loss", "seq_load_balancing_loss",
        "global_load_balancing_loss", "z_loss")


def _worker(rank: int, world_size: int, extra: str):
    history, weights = _train(f"{CP_BASE} {extra}", world_size)
    return history, {k: v.numpy() for k, v in weights.items()}


_SINGLE: dict[str, tuple] = {}


def _single(extra: str):
    if extra not in _SINGLE:
        _SINGLE[extra] = _train(f"{CP_BASE} {extra}", 1)
    return _SINGLE[extra]


def _check(per_rank, single_extra: str, dense_only: bool) -> None:
    single_hist, single_w = _single(single_extra)
    for rank, (hist, weights) in enumerate(per_rank):
        assert len(hist) == len(single_hist) == 4
        for a, b in zip(single_hist, hist):
            for k in (k for k in KEYS if k in a):  # the losses the run has
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (rank, k, single_hist, hist)
        if dense_only:  # every weight whole on every rank (no TP/EP/PP slicing)
            for k, w in weights.items():
                ref = single_w[k]
                assert (torch.as_tensor(w) - ref).abs().max() <= 1e-5 * ref.abs().max(), k


@pytest.mark.parametrize("docs", [
    True, pytest.param(False, marks=pytest.mark.slow)])
def test_cp2_matches_single_process(docs):
    extra = DOCS if docs else ""
    _check(run_distributed(_worker, 2, 240, f"--context-parallel-size 2 {extra}"), extra,
           dense_only=True)


@pytest.mark.slow  # (default-set budget: a representative case stays)
def test_cp2_a2a_matches_single_process():
    """--cp-comm-type a2a (Ulysses: heads exchanged for the sequence), with documents."""
    _check(run_distributed(_worker, 2, 240, f"--context-parallel-size 2 --cp-comm-type a2a "
                                            f"{DOCS}"), DOCS, dense_only=True)


# With DP > 1, one micro-batch per rank: global_aux_loss counts the tokens seen so far in
# the global batch, so with several micro-batches per dp rank its per-micro-batch values
# differ from one process's by design (as in test_pretrain.py's global-aux DP test); the
# single-process run then takes the whole global batch as one micro-batch.
# aux_loss / seq_aux_loss are per-micro-batch statistics, so that cut must not change
# either: those runs balance with global_aux_loss only.
GLOBAL_ONLY = "--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-2"
ONE_MB = (f"--global-batch-size 4 {GLOBAL_ONLY}",
          f"--micro-batch-size 4 --global-batch-size 4 {GLOBAL_ONLY}")


@pytest.mark.slow
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("layout,world,single_extra", [
    ("--context-parallel-size 2 --cp-comm-type allgather", 2, ""),
    ("--context-parallel-size 2 --cp-comm-type p2p allgather", 2, ""),  # one per layer
    ("--context-parallel-size 2 --cp-comm-type a2a p2p", 2, ""),
    ("--context-parallel-size 2 --cp-comm-type a2a --expert-model-parallel-size 2", 2, ""),
    ("--context-parallel-size 2 --cp-comm-type a2a --recompute-granularity selective "
     "--recompute-modules core_attn", 2, ""),
    ("--context-parallel-size 2 --expert-model-parallel-size 2", 2, ""),
    ("--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel", 4, ""),
    ("--context-parallel-size 2 --pipeline-model-parallel-size 2", 4, ""),
    ("--context-parallel-size 4 --use-distributed-optimizer", 4, ""),
    # recompute replays the ring (full: the whole layer; selective: its modules), and the
    # routers' cp count sums are replayed, not re-reduced
    ("--context-parallel-size 2 --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers 1", 2, ""),
    ("--context-parallel-size 2 --recompute-granularity selective "
     "--recompute-modules core_attn moe layernorm", 2, ""),
    ("--context-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce "
     f"{ONE_MB[0]}", 4, ONE_MB[1]),
])
def test_cp_layouts_match_single_process(layout, world, single_extra, docs):
    extra = DOCS if docs else ""
    if docs and single_extra:  # without --calculate-per-token-loss the loss is the mean of
        # per-micro-batch means: with --eod-mask-loss (uneven counts) it depends on how the
        # global batch is cut into micro-batches, which ONE_MB changes
        extra = extra.replace("--eod-mask-loss", "")
    _check(run_distributed(_worker, world, 600, f"{layout} {extra}"),
           f"{single_extra} {extra}".strip(), dense_only=False)


@pytest.mark.parametrize("extra,message", [
    ("--context-parallel-size 2 --cp-comm-type a2a+p2p",
     "not supported yet: --cp-comm-type a2a+p2p"),
    ("--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
     "--cp-comm-type a2a",
     "--cp-comm-type a2a needs the attention heads (2) and key/value heads (1) per "
     "tensor-parallel rank to be multiples of --context-parallel-size (2)"),
    ("--context-parallel-size 3", "must be divisible by 2 x --context-parallel-size"),
])
def test_cp_refusals(capsys, extra, message):
    world = 3 if "size 3" in extra else 4 if "tensor-model-parallel-size 2" in extra else 2
    assert message in parse_error(capsys, f"{TINY_MOE} --train-iters 1 {extra}",
                                  world_size=world)


def _history(rank: int, world_size: int, extra: str) -> list[dict]:
    return _train(f"{CP_BASE} {extra}", world_size)[0]


@pytest.mark.slow
def test_cp_attention_dropout_is_replayed_by_recompute():
    """With attention dropout under CP (masks drawn per ring block), recomputing the core
    attention replays the same masks: the run equals the one without recompute, and both
    differ from the run without dropout."""
    cp2 = f"--context-parallel-size 2 {DOCS} --attention-dropout 0.3"
    plain = run_distributed(_history, 2, 300, cp2)[0]
    replayed = run_distributed(_history, 2, 300, f"{cp2} --recompute-granularity selective "
                               "--recompute-modules core_attn")[0]
    no_dropout = run_distributed(_history, 2, 300, cp2.replace("0.3", "0.0"))[0]
    for a, b in zip(plain, replayed):
        for k in ("lm loss", "grad norm"):
            assert abs(a[k] - b[k]) <= 1e-6 * abs(a[k]), (k, plain, replayed)
    assert abs(plain[0]["lm loss"] - no_dropout[0]["lm loss"]) > 1e-4


def _lm_losses(rank: int, world_size: int, extra: str) -> list[float]:
    return [h["lm loss"] for h in _train(f"{CP_BASE} {extra}", world_size)[0]]


@pytest.mark.slow
def test_cp2_checkpoint_loads_at_cp1_and_back(tmp_path):
    """torch_dist: a CP=2 run with the distributed optimizer (its shards span cp) saves
    at iteration 2; one process loads it and finishes with the unchanged run's losses;
    and a one-process checkpoint resumes under CP=2 the same way."""
    reference = _lm_losses(0, 1, "")
    cp2 = "--context-parallel-size 2 --use-distributed-optimizer"
    src = str(tmp_path / "cp2")
    for losses in run_distributed(_lm_losses, 2, 300, f"{cp2} --exit-interval 2 "
                                  f"--save-interval 2 --save {src}"):
        _close(losses, reference[:2])
    _close(_lm_losses(0, 1, f"--load {src}"), reference[2:])
    one = str(tmp_path / "one")
    _close(_lm_losses(0, 1, f"--exit-interval 2 --save-interval 2 --save {one}"),
           reference[:2])
    for losses in run_distributed(_lm_losses, 2, 300, f"{cp2} --load {one}"):
        _close(losses, reference[2:])


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b)), (a, b)
