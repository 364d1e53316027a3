"""--calculate-per-token-loss with Megatron's meaning: the step's LM loss is the sum of the
per-token losses over every unmasked token of the global batch divided by their number,
whatever the micro-batches, data-parallel and context-parallel ranks it is cut into
(training/loss.py). With --eod-mask-loss the token counts differ between micro-batches,
which is where it differs from the default mean of per-micro-batch means."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.training.test_pretrain_expert_parallel import _train

DOCS = "--reset-attention-mask --reset-position-ids --eod-mask-loss"
PER_TOKEN = f"--calculate-per-token-loss {DOCS}"
NO_MOE_LOSSES = "--moe-aux-loss-coeff 0 --moe-z-loss-coeff 0"  # those are per micro-batch


def _losses(extra: str, keys=("lm loss", "grad norm")) -> list[tuple[float, ...]]:
    return [tuple(h[k] for k in keys) for h in _train(extra, 1)[0]]


def _cuts(model: str = "", keys=("lm loss", "grad norm")) -> tuple[list, list, list, list]:
    """`keys` per iteration of one process for `model`: per-token with 4 micro-batches of
    2 and with 1 of 8, then the default mean with 1 of 8 and with 4 of 2."""
    one = "--micro-batch-size 8"
    return (_losses(f"{model} {PER_TOKEN} {NO_MOE_LOSSES}", keys),
            _losses(f"{model} {PER_TOKEN} {NO_MOE_LOSSES} {one}", keys),
            _losses(f"{model} {DOCS} {NO_MOE_LOSSES} {one}", keys),
            _losses(f"{model} {DOCS} {NO_MOE_LOSSES}", keys))


def _close(a, b, rel=1e-5) -> bool:
    return all(abs(x - y) <= rel * abs(y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def test_per_token_loss_does_not_depend_on_the_micro_batch_cut():
    """Per-token: 4 micro-batches of 2 = 1 micro-batch of 8 (= the default's loss on one
    micro-batch, where the two meanings coincide); the default's mean of means over 4
    micro-batches differs once --eod-mask-loss makes their token counts uneven."""
    per_token_4, per_token_1, mean_1, mean_4 = _cuts()
    assert _close(per_token_4, per_token_1), (per_token_4, per_token_1)
    assert _close(mean_1, per_token_1), (mean_1, per_token_1)
    # (short mock documents: the counts differ by a few tokens, the losses by ~6e-5)
    assert max(abs(m[0] - p[0]) / p[0] for m, p in zip(mean_4, per_token_4)) > 2e-5, (
        mean_4, per_token_4)


KEYS = ("lm loss", "grad norm", "load_balancing_loss", "z_loss")


def _worker(rank: int, world_size: int, extra: str):
    history, _ = _train(extra, world_size)
    return history


def _parity(layout: str, world: int) -> None:
    single = _train(PER_TOKEN, 1)[0]
    for rank, hist in enumerate(run_distributed(_worker, world, 600, f"{PER_TOKEN} {layout}")):
        assert len(hist) == len(single)
        for a, b in zip(single, hist):
            for k in KEYS:
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (rank, k, single, hist)
        # evaluation: the mean over all unmasked tokens of the eval batches, as one process
        assert abs(single[-1]["valid lm loss"] - hist[-1]["valid lm loss"]) <= 1e-5 * abs(
            single[-1]["valid lm loss"]), (rank, single[-1], hist[-1])


@pytest.mark.slow  # (default-set budget: a representative case stays)
def test_per_token_loss_cp2_matches_single_process():
    _parity("--context-parallel-size 2", 2)


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", [
    ("", 2),  # dp 2
    ("--context-parallel-size 2 --use-distributed-optimizer", 4),  # dp 2 x cp 2
    ("--context-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce", 4),
    ("--context-parallel-size 2 --pipeline-model-parallel-size 2", 4),
    ("--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel", 4),
    ("--expert-model-parallel-size 2 --context-parallel-size 2", 4),
])
def test_per_token_loss_layouts_match_single_process(layout, world):
    _parity(layout, world)


MTP = "--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3"
MTP_KEYS = ("lm loss", "grad norm", "mtp_1 loss", "mtp_2 loss")


def test_per_token_mtp_loss_does_not_depend_on_the_micro_batch_cut():
    """Each MTP depth's loss is its per-token mean over the global batch too (its own
    token count: the targets shifted k + 1 places): 4 micro-batches of 2 = 1 of 8, whose
    losses equal the default's; the default's mean of means over 4 differs."""
    per_token_4, per_token_1, mean_1, mean_4 = _cuts(MTP, MTP_KEYS)
    assert _close(per_token_4, per_token_1), (per_token_4, per_token_1)
    assert _close(mean_1, per_token_1), (mean_1, per_token_1)
    for k in (2, 3):  # each depth's logged loss
        assert max(abs(m[k] - p[k]) / p[k] for m, p in zip(mean_4, per_token_4)) > 2e-5, (
            k, mean_4, per_token_4)


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", [
    ("--context-parallel-size 2", 2),
    ("", 2),  # dp 2
    ("--context-parallel-size 2 --pipeline-model-parallel-size 2", 4),
    ("--context-parallel-size 2 --use-distributed-optimizer", 4),  # dp 2 x cp 2
])
def test_per_token_mtp_layouts_match_single_process(layout, world):
    single = _train(f"{PER_TOKEN} {MTP}", 1)[0]
    runs = run_distributed(_worker, world, 600, f"{PER_TOKEN} {MTP} {layout}")
    for rank, hist in enumerate(runs):
        assert len(hist) == len(single)
        for a, b in zip(single, hist):
            for k in KEYS + MTP_KEYS[2:]:
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (rank, k, single, hist)
