"""pretrain_gpt.py-level parity under pipeline parallelism: 1F1B (uneven stages, tied
embeddings), interleaved virtual stages (PP = 4; PP = 2, where both neighbours are one
rank, with evaluation), TP+SP x PP, and Megatron's uneven split flags (a layout string,
the embedding / loss counted as layers, shortened first and last stages, uneven stages
interleaved) give the single-process losses."""

from __future__ import annotations

import shlex
import time

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from tests.distributed import run_distributed
from tests.training.test_pretrain import TINY_MOE

KEYS = ("lm loss", "load_balancing_loss", "z_loss", "grad norm")


def _history(model: str, extra: str, world_size: int) -> list[dict]:
    args = parse_args(shlex.split(f"{model} --train-iters 5 --clip-grad 0.05 {extra}"),
                      world_size=world_size)
    return pretrain(args, print_fn=lambda _msg: None).history


def _worker(rank: int, world_size: int, model: str, extra: str) -> list[dict]:
    return _history(model, extra, world_size)


def _check(model: str, extra: str, world_size: int) -> None:
    single = _history(model, "", 1)
    start = time.time()
    per_rank = run_distributed(_worker, world_size, 300, model, extra)
    print(f"{extra} (world {world_size}): {time.time() - start:.1f} s")
    assert all(h["grad norm"] > 0.05 for h in single)  # clipping active every step
    for hist in per_rank:
        assert len(hist) == len(single) == 5
        for a, b in zip(single, hist):
            for k in KEYS + (("valid lm loss",) if "valid lm loss" in a else ()):
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (k, single, hist)


# Tied embeddings (the embedding-group all-reduce), learned positions, a dense layer first.
TIED = (TINY_MOE.replace("--untie-embeddings-and-output-weights ", "")
        .replace("--position-embedding-type rope", "--position-embedding-type learned_absolute")
        .replace("--num-layers 2", "--num-layers 3") + " --moe-layer-freq ([0]+[1]*2)")


@pytest.mark.slow
def test_pp2_uneven_stages_tied_embeddings():
    _check(TIED, "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1", 2)


@pytest.mark.slow
def test_pp4_interleaved_virtual_stages():
    model = TINY_MOE.replace("--num-layers 2", "--num-layers 8")
    _check(model, "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1",
           4)


@pytest.mark.slow
def test_pp2_interleaved_training_and_evaluation():
    model = (TINY_MOE.replace("--num-layers 2", "--num-layers 4")
             + " --eval-interval 2 --eval-iters 2")
    _check(model, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
           2)


@pytest.mark.slow
def test_tp2_sp_x_pp2():
    _check(TINY_MOE, "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 "
                     "--sequence-parallel", 4)


@pytest.mark.slow
def test_pp2_1f1b_even_untied():
    _check(TINY_MOE, "--pipeline-model-parallel-size 2", 2)


def test_pp2_layout_string_interleaved_uneven_tied_embeddings():
    """The default set's pipeline case: --pipeline-model-parallel-layout over PP2 x VPP2,
    uneven chunks of 1 / 1 / 1 / 0 layers (the last holds only the final norm, output
    layer and loss), tied embeddings across the stages, learned positions, a dense layer
    first. (Layers out of virtual-stage order, e.g. rank-major, change the losses.)"""
    _check(TIED, "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
                 "'Et|t|t|L'", 2)


@pytest.mark.slow
def test_pp2_layout_string_with_an_empty_stage():
    """Rank 1's first chunk is empty: its input passes straight through to rank 0's second
    chunk (and its gradient straight back)."""
    model = TINY_MOE.replace("--num-layers 2", "--num-layers 4")
    _check(model, "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
                  "'Et||tt|tL'", 2)


@pytest.mark.slow
def test_pp2_account_for_embedding_and_loss_interleaved():
    """(6 + 2) / 2 ranks / 2-layer chunks: chunks of 1, 2, 2, 1 layers."""
    model = TINY_MOE.replace("--num-layers 2", "--num-layers 6")
    _check(model, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
                  "--account-for-embedding-in-pipeline-split "
                  "--account-for-loss-in-pipeline-split", 2)


@pytest.mark.slow
def test_pp2_layout_string_with_mtp_on_the_last_stage():
    """A DeepSeek-V3-style layout (Megatron's "Et*7|t*7mL" recipe, scaled down): the
    embedding's stage shortened, the MTP depth with the loss."""
    model = TINY_MOE.replace("--num-layers 2", "--num-layers 3") + " --mtp-num-layers 1"
    _check(model, "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|t*2mL",
           2)


@pytest.mark.slow
def test_pp2_uneven_first_stage_interleaved():
    """--num-virtual-stages-per-pipeline-rank 2 with a shortened first stage: rank 0's 2
    layers and rank 1's 4 each in two chunks (1 / 2 / 1 / 2 layers)."""
    model = TINY_MOE.replace("--num-layers 2", "--num-layers 6")
    _check(model, "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 "
                  "--num-virtual-stages-per-pipeline-rank 2", 2)


@pytest.mark.slow
def test_pp4_shortened_first_and_last_stages():
    """61-over-PP-style: the first and last stages (embedding, loss) take fewer layers."""
    model = TINY_MOE.replace("--num-layers 2", "--num-layers 6")
    _check(model, "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 "
                  "--decoder-last-pipeline-num-layers 1", 4)


@pytest.mark.parametrize("extra, world, message", [
    ("--pipeline-model-parallel-size 2 --num-layers 3", 2,
     "--num-layers (3) cannot be split over --pipeline-model-parallel-size (2)"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 2,
     "--num-layers (2) must be divisible by --pipeline-model-parallel-size (2) x "
     "--num-layers-per-virtual-pipeline-stage (3)"),
    ("--num-layers-per-virtual-pipeline-stage 1", 1,
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"),
    ("--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 1"
     " --global-batch-size 6", 2,
     "needs the number of micro-batches (3) to be divisible by --pipeline-model-parallel-size"),
    ("--pipeline-model-parallel-size 2 --save /tmp/x --ckpt-format torch", 2,
     "--ckpt-format torch (single file) cannot save with --pipeline-model-parallel-size > 1"),
    ("--pipeline-model-parallel-size 3", 2, "world size 2 is not divisible by"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|tL "
     "--decoder-first-pipeline-num-layers 1", 2,
     "--pipeline-model-parallel-layout cannot be combined with --decoder-first/last"),
    ("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split", 2,
     "--num-layers (2) + 1 for each of --account-for-embedding/loss-in-pipeline-split (3) "
     "must be divisible by --pipeline-model-parallel-size (2)"),
    ("--pipeline-model-parallel-size 2 --mtp-num-layers 1 --pipeline-model-parallel-layout "
     "Et|t|m|L", 2, "not supported yet: --pipeline-model-parallel-layout with the MTP layers"),
])
def test_bad_pipeline_layouts_fail_in_one_line(capsys, extra, world, message):
    with pytest.raises(SystemExit) as exc:
        parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 {extra}"), world_size=world)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err
