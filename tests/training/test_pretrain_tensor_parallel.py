"""pretrain_gpt.py-level parity: tensor (+ sequence) parallel and DP x TP layouts train the
tiny MoE config to the single-process losses; bad TP layouts stop with one line, exit 2."""

from __future__ import annotations

import shlex
import time

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.checkpoint import checkpoint_file, read_dist_tensors
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


def _assert_same_tensors(want: dict, got: dict) -> None:
    """The single-process checkpoint's tensors equal the TP=2 one's. The vocabulary is
    padded as Megatron pads it, 97 ids to a multiple of 128 x TP: the real rows agree."""
    for key, t in want.items():
        g = got[key]
        if key.endswith(("word_embeddings.weight", "output_layer.weight")):
            assert (t.shape[0], g.shape[0]) == (128, 256), key
            t, g = t[:97], g[:97]
        torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("world_size, etp", [
    (2, 2), pytest.param(2, 1, marks=pytest.mark.slow),
    pytest.param(4, 2, marks=pytest.mark.slow)],
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


@pytest.mark.parametrize("extra", [
    "--qk-layernorm",
    pytest.param("--qk-layernorm --qk-layernorm-scope projection", marks=pytest.mark.slow)],
    ids=["per_head", "projection"])
def test_qk_layernorm_under_tensor_parallelism_matches_single_process(tmp_path, extra):
    """--qk-layernorm under TP=2+SP: each rank normalises its own heads with the shared
    weights, whose gradients are summed over TP (Megatron's finalize_model_grads); with
    --qk-layernorm-scope projection the norm weights are sharded like the q/k rows and the
    sum of squares is all-reduced over TP. The torch_dist checkpoints of both layouts hold
    the same (whole, single-process-named) weights."""
    save = "--save-interval 5 --ckpt-format torch_dist --save"
    single = _history(f"{extra} {save} {tmp_path / 'single'}", 1)
    per_rank = run_distributed(_worker, 2, 240, f"{extra} --tensor-model-parallel-size 2 "
                                                f"--sequence-parallel {save} {tmp_path / 'tp'}")
    for hist in per_rank:
        _assert_same(single, hist, ("lm loss", "load_balancing_loss", "z_loss", "grad norm"))
    want, got = (read_dist_tensors(checkpoint_file(str(tmp_path / d)), "model.")
                 for d in ("single", "tp"))
    assert want.keys() == got.keys() and any("q_layernorm" in k for k in want)
    _assert_same_tensors(want, got)


SHARED = "--moe-shared-expert-intermediate-size 32"
TP2_SP = "--tensor-model-parallel-size 2 --sequence-parallel"


@pytest.mark.parametrize("shared, layout, world_size", [
    pytest.param(f"{SHARED} --moe-shared-expert-gate", "", 2, marks=pytest.mark.slow),
    pytest.param(SHARED, "", 2, marks=pytest.mark.slow),
    pytest.param(f"{SHARED} --moe-shared-expert-gate", "--expert-tensor-parallel-size 1", 2,
                 marks=pytest.mark.slow),
    pytest.param(f"{SHARED} --moe-shared-expert-gate --use-distributed-optimizer",
                 "--expert-model-parallel-size 2", 4, marks=pytest.mark.slow),
    pytest.param(f"{SHARED} --moe-shared-expert-gate", "--pipeline-model-parallel-size 2", 4,
                 marks=pytest.mark.slow),
], ids=["gate", "no_gate", "gate_etp1", "gate_ep2_distopt", "gate_pp2"])
def test_shared_experts_split_over_tp_match_single_process(tmp_path, shared, layout,
                                                           world_size):
    """Shared experts (Megatron's TP MLP: fc1 column-, fc2 row-parallel over the sequence
    shards; the gate whole, its gradient summed over TP) under TP=2 + SP, with ETP = TP or
    1, EP=2 and the distributed optimizer, or PP=2: the single-process losses and grad
    norms (clipping active, so a wrong grad norm shows in the losses too), and every
    weight after training (a gate whose gradient stayed partial barely moves the losses
    under Adam, but its weights drift apart)."""
    save = "--save-interval 5 --ckpt-format torch_dist --save"
    single = _history(f"{shared} {save} {tmp_path / 'single'}", 1)
    per_rank = run_distributed(_worker, world_size, 300,
                               f"{shared} {TP2_SP} {layout} {save} {tmp_path / 'tp'}")
    assert all(h["grad norm"] > 0.05 for h in single)
    reported = [hist for hist in per_rank if hist]  # (PP: the last stage reports)
    assert reported
    for hist in reported:
        _assert_same(single, hist, ("lm loss", "load_balancing_loss", "z_loss", "grad norm"))
    want, got = (read_dist_tensors(checkpoint_file(str(tmp_path / d)), "model.")
                 for d in ("single", "tp"))
    assert want.keys() == got.keys() and any("shared_experts.linear_fc2" in k for k in want)
    assert any("shared_experts.gate_weight" in k for k in want) == ("gate" in shared)
    _assert_same_tensors(want, got)


def _fails(capsys, extra: str, world_size: int) -> str:
    return parse_error(capsys, f"{TINY_MOE} --train-iters 1 {extra}", world_size)


@pytest.mark.parametrize("extra, world, message", [
    ("--tensor-model-parallel-size 2", 2,
     "MoE with --tensor-model-parallel-size > 1 requires --sequence-parallel"),
    ("--tensor-model-parallel-size 4 --sequence-parallel", 2,
     "world size 2 is not divisible by --tensor-model-parallel-size (4)"),
    ("--tensor-model-parallel-size 4 --sequence-parallel", 4,
     "--num-query-groups (2) must be divisible by --tensor-model-parallel-size (4)"),
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
    ("--tensor-model-parallel-size 2 --sequence-parallel "
     "--moe-shared-expert-intermediate-size 33", 2,
     "--moe-shared-expert-intermediate-size (33) must be divisible by "
     "--tensor-model-parallel-size (2)"),
])
def test_bad_tensor_parallel_layouts_fail_in_one_line(capsys, extra, world, message):
    assert message in _fails(capsys, extra, world)
