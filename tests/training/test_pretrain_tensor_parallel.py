"""pretrain_gpt.py-level parity: tensor (+ sequence) parallel and DP x TP layouts train the
tiny MoE config to the single-process losses; bad TP layouts stop with one line, exit 2."""

from __future__ import annotations

import shlex
import time

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from tests.distributed import run_distributed
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

# A dense first layer and an MoE second layer, so both MLP kinds run under TP.
EXTRA = "--train-iters 5 --moe-layer-freq ([0]+[1]) --clip-grad 0.05"


def _history(extra: str, world_size: int) -> list[dict]:
    args = parse_args(shlex.split(f"{TINY_MOE} {EXTRA} {extra}"), world_size=world_size)
    return pretrain(args, print_fn=lambda _msg: None).history


def _worker(rank: int, world_size: int, extra: str) -> list[dict]:
    return _history(extra, world_size)


def _assert_same(single: list[dict], parallel: list[dict], keys: tuple[str, ...]) -> None:
    assert len(single) == len(parallel) == 5
    for a, b in zip(single, parallel):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (k, single, parallel)


@pytest.mark.parametrize("world_size, etp", [
    (2, 2), (2, 1), pytest.param(4, 2, marks=pytest.mark.slow)],
    ids=["tp2_sp", "tp2_sp_etp1", "dp2_x_tp2_sp"])
def test_tensor_parallel_training_matches_single_process(world_size, etp):
    # ETP = 2 (the default, = TP): experts split over their hidden dimension; ETP = 1:
    # whole experts, the MoE tokens split over the TP ranks.
    single = _history("", 1)
    start = time.time()
    per_rank = run_distributed(_worker, world_size, 240,
                               "--tensor-model-parallel-size 2 --sequence-parallel "
                               f"--expert-tensor-parallel-size {etp}")
    print(f"TP=2+SP ETP={etp} world {world_size}: {time.time() - start:.1f} s")
    keys = ("lm loss", "load_balancing_loss", "z_loss", "grad norm")
    # Clipping is active, so a wrong grad norm would change the losses too.
    assert all(h["grad norm"] > 0.05 for h in single)
    for hist in per_rank:
        _assert_same(single, hist, keys)


def _fails(capsys, extra: str, world_size: int) -> str:
    return parse_error(capsys, f"{TINY_MOE} --train-iters 1 {extra}", world_size)


@pytest.mark.parametrize("extra, world, message", [
    ("--tensor-model-parallel-size 2", 2,
     "MoE with --tensor-model-parallel-size > 1 requires --sequence-parallel"),
    ("--tensor-model-parallel-size 4 --sequence-parallel", 2,
     "world size 2 is not divisible by --tensor-model-parallel-size (4)"),
    ("--tensor-model-parallel-size 4 --sequence-parallel", 4,
     "--num-query-groups (2) must be divisible by --tensor-model-parallel-size (4)"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 3", 2,
     "--make-vocab-size-divisible-by (3) must be divisible by --tensor-model-parallel-size"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --seq-length 15 "
     "--max-position-embeddings 16", 2,
     "--seq-length (15) must be divisible by --tensor-model-parallel-size (2) with "
     "--sequence-parallel"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --save /tmp/x --ckpt-format torch", 2,
     "--ckpt-format torch (single file) cannot save with --tensor-model-parallel-size > 1"),
    ("--expert-tensor-parallel-size 2", 2,
     "not supported yet: --expert-tensor-parallel-size 2 other than 1 or "
     "--tensor-model-parallel-size (1)"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --moe-ffn-hidden-size 33", 2,
     "--moe-ffn-hidden-size (33) must be divisible by --expert-tensor-parallel-size (2)"),
])
def test_bad_tensor_parallel_layouts_fail_in_one_line(capsys, extra, world, message):
    assert message in _fails(capsys, extra, world)
