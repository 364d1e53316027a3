"""--fp8-param-gather (Megatron's FP8 primary weights): the FP8 GEMMs' weights live in FP8 in
the distributed optimizer's buffers and are all-gathered in FP8 (model/fp8/params.py,
training/optim/fp8_shards.py).

In an fp32 model the weights the optimizer quantises from its fp32 main shard are exactly
those the forward would quantise from the fp32 parameter (same amax, same scale), so runs
with and without the flag give the same losses, bitwise on one CPU, and checkpoints move
between them exactly. (In bf16 they differ by the bf16 rounding the flag skips.)"""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from tests.training.test_pretrain import TINY_MOE

PG = "--use-distributed-optimizer --train-iters 4"
RECIPES = {"tensorwise": "--fp8-format hybrid --fp8-recipe tensorwise",
           # weights of 2 x 2 blocks of 128 (partial ones), which DP2's pieces cut
           "blockwise": "--fp8-format e4m3 --fp8-recipe blockwise --hidden-size 160 "
                        "--moe-ffn-hidden-size 144",
           "delayed": "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4"}


def _history(extra: str, world_size: int = 1) -> list[tuple[float, float]]:
    args = parse_args(shlex.split(f"{TINY_MOE} {PG} {extra}"), world_size=world_size)
    return [(h["lm loss"], h["grad norm"])
            for h in pretrain(args, print_fn=lambda _m: None).history]


def _close(a: list, b: list, rel: float) -> bool:
    return all(abs(x - y) <= rel * abs(x) for u, v in zip(a, b) for x, y in zip(u, v))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_fp8_primary_weights_train_as_quantising_in_the_forward(recipe):
    """One process: the same losses bitwise; grad norms to fp32 rounding (with the flag
    the distributed optimizer runs even on one rank, and sums the norm in another order)."""
    plain = _history(RECIPES[recipe])
    primary = _history(f"{RECIPES[recipe]} --fp8-param-gather")
    assert [h[0] for h in primary] == [h[0] for h in plain], (plain, primary)
    assert _close(plain, primary, 1e-6), (plain, primary)


def test_weights_hold_fp8_bytes_only():
    """Every FP8 GEMM's weight is a view of a uint8 buffer of its own shape; the parameter
    keeps no values; the other parameters (router, norms, embeddings) are untouched."""
    from megamoe.cli.mapping import run_config_from_args
    from megamoe.model.fp8.params import primary
    from megamoe.model.fp8.policy import fp8_gemm_modules
    from megamoe.parallel.mesh import single_process_mesh
    from megamoe.training.build import build_model
    from megamoe.training.optim import build_optimizer

    args = parse_args(shlex.split(f"{TINY_MOE} {PG} {RECIPES['tensorwise']} "
                                  "--fp8-param-gather"), world_size=1)
    run = run_config_from_args(args, 97)
    model = build_model(run)
    mesh = single_process_mesh()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    build_optimizer(model, run.optim, mesh=mesh, distributed=True)
    weights = {id(getattr(m, w)) for _, m in fp8_gemm_modules(model)
               for w in ("weight", "fc1_weight", "fc2_weight") if hasattr(m, w)}
    assert weights
    storages, numel = {}, 0
    for name, p in model.named_parameters():
        prim = primary(p)
        assert (prim is not None) == (id(p) in weights), name
        if prim is None:
            assert torch.equal(p, before[name]), name
            continue
        assert p.untyped_storage().nbytes() <= p.element_size(), name
        assert prim.data.dtype == torch.float8_e4m3fn and prim.data.shape == p.shape
        storages[prim.data.untyped_storage().data_ptr()] = prim.data.untyped_storage().nbytes()
        numel += p.numel()
        deq = prim.dequantized(torch.float32)
        groups = deq.reshape(prim.num_scales, -1)
        amax = before[name].reshape(prim.num_scales, -1).abs().amax(dim=1)
        # tensorwise: each weight (expert) scaled by its own amax: E4M3's 3 mantissa bits
        assert ((groups - before[name].reshape(prim.num_scales, -1)).abs()
                <= amax[:, None] / 16 + 1e-12).all(), name
        assert torch.allclose(groups.abs().amax(dim=1), amax, rtol=1 / 16), name
    assert sum(storages.values()) == numel  # 1 byte per value, one buffer (one rank: no padding)


def test_blockwise_primary_weights_are_the_forwards_128x128_blocks():
    """Blockwise: each weight (each expert's [K, M]) holds exactly the 128x128-block
    quantisation the forward makes without the flag (power-of-2 block scales; weights of
    160 x 160-ish cut into full and partial blocks)."""
    from megamoe.cli.mapping import run_config_from_args
    from megamoe.model.fp8.blocks import quantize_operand
    from megamoe.model.fp8.params import primary
    from megamoe.parallel.mesh import single_process_mesh
    from megamoe.training.build import build_model
    from megamoe.training.optim import build_optimizer

    args = parse_args(shlex.split(f"{TINY_MOE} {PG} {RECIPES['blockwise']} "
                                  "--fp8-param-gather"), world_size=1)
    run = run_config_from_args(args, 97)
    model = build_model(run)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    build_optimizer(model, run.optim, mesh=single_process_mesh(), distributed=True)
    seen = 0
    for name, p in model.named_parameters():
        prim = primary(p)
        if prim is None:
            continue
        w = before[name]
        if w.dim() == 2:
            ref = quantize_operand(w, "blockwise", torch.float8_e4m3fn, weight=True).dequantize()
        else:  # the forward quantises each expert's W_e^T [M, K]: the same blocks
            ref = torch.stack([quantize_operand(w_e.t(), "blockwise", torch.float8_e4m3fn,
                                                weight=True).dequantize().t() for w_e in w])
        assert torch.equal(prim.dequantized(torch.float32), ref), name
        seen += prim.num_scales > prim.lead
    assert seen  # some weight has several blocks


def _dp_worker(rank: int, world_size: int, recipe: str, extra: str) -> tuple[list, list]:
    from megamoe.training.optim import flat_shards, fp8_shards

    plain = _history(f"{RECIPES[recipe]} {extra}", world_size)
    sent: list[torch.dtype] = []
    gather = fp8_shards.all_gather

    def recording(out, own, **kw):
        sent.append(own.dtype)
        return gather(out, own, **kw)

    fp8_shards.all_gather = recording
    try:
        primary = _history(f"{RECIPES[recipe]} {extra} --fp8-param-gather", world_size)
    finally:
        fp8_shards.all_gather = gather
    assert set(sent) == ({torch.uint8} if "tensor-model" not in extra else set()), sent
    assert flat_shards.all_gather is gather  # the other buffers' gathers are the usual ones
    return plain, primary


@pytest.mark.parametrize("recipe,extra", [
    ("tensorwise", ""),
    ("blockwise", ""),
    pytest.param("delayed", "", marks=pytest.mark.slow),
    pytest.param("tensorwise", "--overlap-grad-reduce --overlap-param-gather "
                 "--ddp-bucket-size 2000", marks=pytest.mark.slow),
    pytest.param("delayed", "--expert-model-parallel-size 2", marks=pytest.mark.slow),
    pytest.param("delayed", "--tp-only-amax-red", marks=pytest.mark.slow),
    pytest.param("tensorwise", "--tensor-model-parallel-size 2 --sequence-parallel",
                 marks=pytest.mark.slow),
])
def test_data_parallel_gathers_fp8_and_trains_as_without_the_flag(recipe, extra):
    """DP2: dense and expert weights sharded over two ranks (pieces cross expert
    boundaries), each weight's scale from the max-reduced amax of its pieces, FP8 bytes
    all-gathered: the losses of DP2 without the flag, bitwise (grad norms to fp32
    rounding: the flag adds buffers, which changes the norm's summation order). Slow:
    delayed, the gathers overlapped with the forward in buckets, EP2 (experts unsharded:
    EDP 1), TP2+SP (DP 1: nothing gathered; per-shard scales, as without the flag) and
    delayed with --tp-only-amax-red (the cast reduces each weight's amax over DP itself, as
    TE: else the DP ranks' scales part and the gathered bytes decode wrong)."""
    from tests.distributed import run_distributed

    for plain, primary in run_distributed(_dp_worker, 2, 240, recipe, extra):
        assert [h[0] for h in primary] == [h[0] for h in plain], (plain, primary)
        assert _close(plain, primary, 1e-6), (plain, primary)


def test_checkpoints_move_between_fp8_primary_and_plain_runs(tmp_path):
    """Delayed scaling, torch_dist: 2 steps with the flag, saved, 2 more with the flag or
    without it give the 4 straight steps' losses exactly (the main parameters and the amax
    histories come back; the FP8 bytes are quantised again from them); and a checkpoint
    of a run without the flag resumes with it."""
    delayed = RECIPES["delayed"]
    straight = [h[0] for h in _history(f"{delayed} --fp8-param-gather")]
    half = f"{delayed} --train-iters 2 --save-interval 2"
    for saved_with in ("--fp8-param-gather", ""):
        ckpt = tmp_path / f"ckpt{len(saved_with)}"
        _history(f"{half} {saved_with} --save {ckpt}".replace(PG, ""))
        for resumed_with in ("--fp8-param-gather", ""):
            resumed = [h[0] for h in _history(f"{delayed} {resumed_with} --load {ckpt}")]
            assert resumed == straight[2:], (saved_with, resumed_with, straight, resumed)


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data")


@pytest.mark.parametrize("flags,says", [
    ("--fp8-param-gather --use-distributed-optimizer",
     "--fp8-param-gather must be used together with --fp8-format"),
    ("--fp8-format e4m3 --fp8-recipe tensorwise --fp8-param-gather",
     "--fp8-param-gather only supported with distributed optimizer"),
    ("--fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather --use-distributed-optimizer",
     "not supported yet: --fp8-param-gather with --fp8-recipe mxfp8"),
    ("--fp8-format e4m3 --fp8-param-gather --use-distributed-optimizer "
     "--transformer-impl transformer_engine",
     "not supported yet: --fp8-param-gather with --transformer-impl transformer_engine"),
    ("--fp8-format e4m3 --fp8-recipe tensorwise --fp8-param-gather "
     "--use-distributed-optimizer --ckpt-format torch --save /nonexistent/ckpt",
     "not supported yet: --fp8-param-gather with --ckpt-format torch"),
])
def test_fp8_param_gather_refusals_are_one_line(capsys, flags, says):
    from tests.flags import parse_error

    err = parse_error(capsys, f"{BASE} {flags}", 1)
    assert says in err, err


def test_dry_run_counts_fp8_primary_weights():
    """--dry-run with the flag (fp32 model, one rank): the weights shrink by 3 bytes per
    FP8 weight value (4 -> 1), the optimizer gains their fp32 main (4 bytes), and autograd
    keeps no FP8 weight copies (tensorwise: 1 byte per value less); the count is the
    built model's marked weights."""
    import json

    from megamoe.cli.mapping import run_config_from_args
    from megamoe.model.fp8.params import primary
    from megamoe.training.build import build_model

    flags = f"{TINY_MOE} {PG} {RECIPES['tensorwise']}"

    def report(extra: str) -> dict:
        out: list[str] = []
        pretrain(parse_args(shlex.split(f"{flags} {extra} --dry-run --json"), world_size=1),
                 print_fn=out.append)
        return json.loads(out[-1])

    plain, held = report(""), report("--fp8-param-gather")
    run = run_config_from_args(parse_args(shlex.split(f"{flags} --fp8-param-gather"),
                                          world_size=1), 97)
    count = sum(p.numel() for p in build_model(run).parameters() if primary(p) is not None)
    assert held["fp8"]["fp8_primary_weight_values_per_rank"] == count > 0
    a, b = plain["per_rank_memory_bytes"], held["per_rank_memory_bytes"]
    assert a["weights"] - b["weights"] == 3 * count
    assert b["optimizer"] - a["optimizer"] == 4 * count
    assert (plain["fp8"]["fp8_copy_bytes_per_rank"] - held["fp8"]["fp8_copy_bytes_per_rank"]
            == count)
