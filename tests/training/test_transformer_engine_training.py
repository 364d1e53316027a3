"""Training with --transformer-impl transformer_engine (TE: the stand-in of
tests/te_stand_in). Checkpoints move between local and transformer_engine runs: the same
parameters under the same names either way, TE's extra state carried in common.pt and
restored by a TE run, ignored by a local one; and the command line's one-line refusals of
what the TE path does not build yet. (Without TE: tests/scripts/test_megatron_flags.py.)
CP2 on TE against one local process; slow: EP2, PP2, TP2+SP (ETP 2 and 1), CP2 a2a, MLA
at CP2, a dense model at TP2 without SP (and at DP2 x TP2 with overlapped reduce-scatters).
"""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli import main as cli_main
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.model.te.extra_state import TeExtraState
from megamoe.training.checkpoint.safe_load import CheckpointError
from tests.model.test_transformer_engine_mla import MLA
from tests.te_stand_in import installed
from tests.training.test_pretrain import TINY_MOE

TE = "--transformer-impl transformer_engine"
# TE's kernels may sum in another order than the local ones (the stand-in's experts are a
# per-group loop, the local grouped GEMM is torch's): compared to fp32 rounding. (Measured
# on this CPU: equal.)
RTOL = 1e-5


def _losses(extra: str) -> list[float]:
    args = parse_args(shlex.split(f"{TINY_MOE} {extra}"), world_size=1)
    return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b))


def test_a_checkpoint_moves_between_local_and_transformer_engine(tmp_path):
    """4 local steps straight; 2 local steps saved then 2 TE steps from that checkpoint;
    2 TE steps saved then 2 local steps: the same losses (to fp32 rounding)."""
    straight = _losses("--train-iters 4")
    local_ckpt, te_ckpt = tmp_path / "local", tmp_path / "te"
    _losses(f"--train-iters 2 --save {local_ckpt} --save-interval 2")
    with installed():
        te_resumed = _losses(f"--train-iters 4 {TE} --load {local_ckpt}")
        _losses(f"--train-iters 2 {TE} --save {te_ckpt} --save-interval 2")
    local_resumed = _losses(f"--train-iters 4 --load {te_ckpt}")
    assert _close(te_resumed, straight[2:]), (te_resumed, straight)
    assert _close(local_resumed, straight[2:]), (local_resumed, straight)


def test_tes_extra_state_is_saved_and_restored(tmp_path, monkeypatch):
    """Delayed scaling under TE: common.pt holds every TE module's extra state; a TE run
    resuming from it is handed exactly that state (a corrupted one is named with the
    file, in one line); a local FP8 run loads the same
    checkpoint (its own scaling starts fresh, as from any checkpoint without it)."""
    ckpt = tmp_path / "ckpt"
    flags = f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4"
    with installed():
        _losses(f"--train-iters 2 {flags} --save {ckpt} --save-interval 2")
        saved = torch.load(ckpt / "iter_0000002" / "common.pt", weights_only=False)
        states = saved["te_extra_state"]
        assert len(states) == 1 and "decoder.layers.1.mlp.experts.linear_fc1" in states[0]
        assert all(t.dtype == torch.uint8 and t.numel() for t in states[0].values())
        loaded = []
        real_load = TeExtraState.load_state_dict
        monkeypatch.setattr(TeExtraState, "load_state_dict",
                            lambda self, state, where="": (loaded.append(state),
                                                           real_load(self, state, where)))
        _losses(f"--train-iters 2 {flags} --load {ckpt}")  # loads, runs no step
        assert len(loaded) == 1 and loaded[0].keys() == states[0].keys()
        assert all(torch.equal(loaded[0][k], states[0][k]) for k in states[0])
        common = ckpt / "iter_0000002" / "common.pt"
        saved["te_extra_state"] = [{k: torch.zeros(2) for k in states[0]}]  # corrupted
        torch.save(saved, common)
        with pytest.raises(CheckpointError, match="1-D uint8") as e:
            _losses(f"--train-iters 2 {flags} --load {ckpt}")
        assert str(common.parent) in str(e.value) and "\n" not in str(e.value)
        saved["te_extra_state"] = states
        torch.save(saved, common)
    assert _losses("--train-iters 3 --fp8-format hybrid --fp8-recipe delayed "
                   f"--fp8-amax-history-len 4 --load {ckpt}")  # a local run takes it


@pytest.mark.parametrize("flags,says", [
    ("--recompute-granularity selective --recompute-modules layernorm",
     "not supported yet: --recompute-modules layernorm"),
    ("--reset-attention-mask", "not supported yet: --reset-attention-mask"),
])
def test_cli_names_what_te_does_not_build_yet(capsys, flags, says):
    with installed():
        rc = cli_main.main(shlex.split(f"{TINY_MOE} --train-iters 1 {TE} {flags}"))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and says in err, err


def _te_worker(rank: int, world_size: int, extra: str) -> list[float]:
    with installed():  # (each spawned process installs the stand-in itself)
        args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 3 {TE} {extra}"),
                          world_size=world_size)
        return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


def _loss_and_norm(flags: str, world_size: int = 1) -> list[tuple[float, float]]:
    args = parse_args(shlex.split(flags), world_size=world_size)
    return [(h["lm loss"], h["grad norm"])
            for h in pretrain(args, print_fn=lambda _m: None).history]


def _te_loss_and_norm_worker(rank: int, world_size: int, flags: str):
    with installed():
        return _loss_and_norm(f"{flags} {TE}", world_size)


# --clip-grad 0.05: clipping active, so a wrong grad norm changes the later losses too
MIXED = f"{TINY_MOE} --train-iters 3 --moe-layer-freq ([0]+[1]) --clip-grad 0.05"
DENSE = (TINY_MOE.replace("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 "
                          "--moe-grouped-gemm --moe-aux-loss-coeff 1e-2 "
                          "--moe-z-loss-coeff 1e-3 ", "")
         + " --train-iters 3 --normalization LayerNorm --add-qkv-bias --clip-grad 0.05")


def _same_losses_and_norms(want: list, got: list) -> None:
    """1e-5 relative: the layouts' reductions sum in another order than one process."""
    assert len(want) == len(got) == 3
    for (la, na), (lb, nb) in zip(want, got):
        assert abs(la - lb) <= 1e-5 * abs(la) and abs(na - nb) <= 1e-5 * abs(na), (want, got)
    assert all(n > 0.05 for _, n in want)  # (the clipping was active)


@pytest.mark.parametrize("flags,layout", [
    (MIXED, "--context-parallel-size 2"),
    pytest.param(MIXED, "--context-parallel-size 2 --cp-comm-type a2a",
                 marks=pytest.mark.slow),
    pytest.param(MIXED, "--tensor-model-parallel-size 2 --sequence-parallel",
                 marks=pytest.mark.slow),
    pytest.param(MIXED, "--tensor-model-parallel-size 2 --sequence-parallel "
                 "--expert-tensor-parallel-size 1", marks=pytest.mark.slow),
    pytest.param(DENSE, "--tensor-model-parallel-size 2", marks=pytest.mark.slow),
    pytest.param(DENSE, "--tensor-model-parallel-size 2 --use-distributed-optimizer "
                 "--overlap-grad-reduce", marks=pytest.mark.slow),
    pytest.param(f"{MLA} --q-lora-rank 16 --qk-layernorm --train-iters 3 --clip-grad 0.05",
                 "--context-parallel-size 2",
                 marks=pytest.mark.slow)],
    ids=["cp2", "cp2_a2a", "tp2_sp", "tp2_sp_etp1", "dense_tp2", "dense_dp2_x_tp2_overlap",
         "mla_cp2"])
def test_te_tensor_and_context_parallel_training_matches_one_process(flags, layout):
    """3 steps under TE (CP: megamoe's CP core attention, TE's linears; TP: TE's local
    GEMMs inside megamoe's TP layers, the fused norms' gradients summed over TP; with the
    distributed optimizer's overlapped reduce-scatters, on their slices) give one local
    process's losses and grad norms, and TE's at one process. 2 ranks; DP2 x TP2 on 4."""
    from tests.distributed import run_distributed

    single = _loss_and_norm(flags)
    with installed():
        te_single = _loss_and_norm(f"{flags} {TE}")
    _same_losses_and_norms(single, te_single)
    world = 4 if "--overlap-grad-reduce" in layout else 2
    for got in run_distributed(_te_loss_and_norm_worker, world, 240, f"{flags} {layout}"):
        _same_losses_and_norms(single, got)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
    "--pipeline-model-parallel-size 2",
])
def test_te_layouts_match_one_local_process(extra):
    """EP2 (GroupedLinear over each rank's local experts) and PP2 (TE modules in each stage)
    on TE give one local process's losses, to fp32 rounding (1e-5, as the other layout
    tests: the gloo reductions sum in another order)."""
    from tests.distributed import run_distributed

    single = _losses("--train-iters 3")
    per_rank = run_distributed(_te_worker, 2, 240, extra)
    last = per_rank[-1]  # (PP: the last stage reports the loss)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(last, single)), (single, last)
    assert len(last) == len(single)


def _te_tp_run(rank: int, world_size: int, extra: str) -> tuple[list[float], list[str]]:
    lines: list[str] = []
    with installed():
        args = parse_args(shlex.split(
            f"{TINY_MOE} {TE} --fp8-format hybrid --fp8-recipe delayed "
            f"--fp8-amax-history-len 4 --tensor-model-parallel-size 2 --sequence-parallel "
            f"{extra}"), world_size=world_size)
        history = pretrain(args, print_fn=lines.append).history
    return [h["lm loss"] for h in history], lines


@pytest.mark.slow
def test_te_tensor_parallel_resume_restores_each_ranks_extra_state(tmp_path):
    """TP2+SP under TE with delayed scaling: common.pt holds one extra-state dict per rank
    (the same module names: every TP rank has its shard of every module), a resume under
    the same layout restores them (no "starts fresh" line) and continues the straight
    run's losses (the stand-in's amax state does not change its fp32 math: this proves the
    wiring, not FP8 numerics)."""
    from tests.distributed import run_distributed

    ckpt = tmp_path / "ckpt"
    straight = run_distributed(_te_tp_run, 2, 240, "--train-iters 4")[0][0]
    run_distributed(_te_tp_run, 2, 240, f"--train-iters 2 --save {ckpt} --save-interval 2")
    saved = torch.load(ckpt / "iter_0000002" / "common.pt", weights_only=False)
    states = saved["te_extra_state"]
    assert len(states) == 2 and states[0].keys() == states[1].keys()
    assert "decoder.layers.0.self_attention.core_attention" in states[0]
    assert all(t.numel() for s in states for k, t in s.items() if "linear" in k)
    for losses, lines in run_distributed(_te_tp_run, 2, 240, f"--train-iters 4 --load {ckpt}"):
        said = [m for m in lines if "Transformer Engine" in m]
        assert not said, said
        assert _close(losses, straight[2:]), (losses, straight)


@pytest.mark.slow
def test_te_output_proj_under_tensor_parallelism_matches_te_at_one_process():
    """--fp8-output-proj (MXFP8) at TP2+SP: each rank's TE Linear multiplies its vocabulary
    shard; rank 1 of 97 ids padded to 256 rows holds padding only (lm_head hands the GEMM
    an empty view of its table: model/te/output.py). TE's losses and grad norms at one
    process (the stand-in computes fp32 on both: the local path's MXFP8 emulation is not
    the comparison)."""
    from tests.distributed import run_distributed

    flags = f"{MIXED} --fp8-format e4m3 --fp8-recipe mxfp8 --fp8-output-proj"
    with installed():
        te_single = _loss_and_norm(f"{flags} {TE}")
    layout = "--tensor-model-parallel-size 2 --sequence-parallel"
    for got in run_distributed(_te_loss_and_norm_worker, 2, 240, f"{flags} {layout}"):
        _same_losses_and_norms(te_single, got)
