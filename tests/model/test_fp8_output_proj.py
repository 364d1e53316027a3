"""--fp8-output-proj (Megatron-LM d98e8a64: TransformerConfig.fp8_output_proj,
TELMHeadColumnParallelLinear): the output layer's GEMMs, for the LM head and every MTP
head, run in MXFP8 (forward, dgrad, wgrad) on the local path and on TE's Linear under
--transformer-impl transformer_engine; off, nothing changes; Megatron's rules are one
line; the planner prices and counts the head in FP8."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
import torch
import torch.distributed as dist

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.cli.mapping import run_config_from_args
from megamoe.model.fp8.policy import Fp8Gemm, Fp8State, apply_fp8
from megamoe.model.fp8.quantize import format_dtypes
from megamoe.model.gpt_model import GPTModel, lm_head
from megamoe.model.pipeline_stage import GPTStage
from megamoe.parallel.tensor_parallel import SINGLE, TensorParallel
from megamoe.planning.fp8_memory import fp8_copy_bytes, fp8_report
from megamoe.planning.fp8_time import fp8_gemm_flops_per_token
from megamoe.planning.memory import Layout
from megamoe.planning.planner import layout_run
from megamoe.training.build import build_model
from tests.model.test_fp8_blocks import _naive
from tests.te_stand_in import installed
from tests.training.test_pretrain import TINY_MOE

MX = "--fp8-format hybrid --fp8-recipe mxfp8"
FLAG = f"{MX} --fp8-output-proj"
TIED = TINY_MOE.replace("--untie-embeddings-and-output-weights ", "")


def _run(extra: str):
    return run_config_from_args(parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 {extra}"),
                                           world_size=1), 97)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _head(model, gemm, h_SBH, w_VH):
    """The output layer alone: logits [B, S, V] and (dh, dW) for a fixed output gradient."""
    h, w = h_SBH.clone().requires_grad_(), w_VH.detach().clone().requires_grad_()
    logits = lm_head(h, w, None, model.config, SINGLE, gemm)
    logits.backward(torch.linspace(-1, 1, logits.numel()).reshape(logits.shape))
    return logits.detach(), h.grad, w.grad


def test_output_layer_runs_in_mxfp8_within_the_bound():
    """Against the same head in high precision: logits within E4M3's 2u (2^-3) and both
    gradients within E5M2's 2u (2^-2), the bounds of tests/model/test_fp8_policy.py (same
    argument: four operand roundings add in quadrature to ~1.15u), and not equal (it did
    quantise). Tight against a naive tile loop: the logits are the product of the 1x32
    E8M0-scaled operands (tests/model/test_fp8_blocks.py::_naive) up to fp32 summation
    order (1e-5). The real-vocabulary rows only, as the bf16 head."""
    model = build_model(_run(FLAG))
    torch.manual_seed(5)
    h_SBH = torch.randn(16, 2, 32)
    w_VH = model.output_weight()
    ref = _head(model, None, h_SBH, w_VH)
    got = _head(model, model.output_fp8, h_SBH, w_VH)
    assert got[0].shape == (2, 16, 97)
    assert 0 < _rel(got[0], ref[0]) < 2.0 ** -3, _rel(got[0], ref[0])
    for g, r in zip(got[1:], ref[1:]):
        assert 0 < _rel(g, r) < 2.0 ** -2, _rel(g, r)
    fwd, _ = format_dtypes("hybrid")
    hq, _ = _naive(h_SBH.transpose(0, 1).reshape(32, 32), "mxfp8", fwd)
    wq, _ = _naive(w_VH.detach()[:97], "mxfp8", fwd, weight=True)
    torch.testing.assert_close(got[0].reshape(32, 97), hq @ wq.t(), rtol=1e-5, atol=1e-5)
    assert not bool(got[2][97:].any())  # padded rows: never multiplied


def test_every_head_runs_it_and_the_flag_off_changes_nothing():
    """With an MTP depth the output GEMM runs twice per forward (the LM head and the MTP
    head: Megatron's process_mtp_loss calls the same output_layer). Without the flag no
    module has an output GEMM and the model is the flagged one with its head back in high
    precision: same parameters, bitwise the same loss; the flag changes the loss."""
    on, off = build_model(_run(f"{FLAG} --mtp-num-layers 1")), \
        build_model(_run(f"{MX} --mtp-num-layers 1"))
    assert all(getattr(m, "output_fp8", None) is None for m in off.modules())
    assert set(on.fp8_state.scalings) - set(off.fp8_state.scalings) == {"output_layer"}
    assert all(torch.equal(a, b) for a, b in zip(on.state_dict().values(),
                                                 off.state_dict().values()))
    calls, gemm = [], on.output_fp8
    on.output_fp8 = lambda *a: calls.append(a[0].shape) or gemm(*a)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    loss_on = on(tokens, labels=tokens)
    assert len(calls) == 2, calls
    loss_off = off(tokens, labels=tokens)
    assert not torch.equal(loss_on, loss_off)
    on.output_fp8 = None
    assert torch.equal(on(tokens, labels=tokens), loss_off)


def test_a_tied_last_pipeline_stage_runs_its_copy_in_mxfp8():
    """Tied embeddings under PP (Megatron accepts them there: the last stage's output
    layer owns the copy it multiplies): the last stage's head multiplies its copy of the
    word embedding in MXFP8 and the gradient lands on that copy."""
    run = _run(FLAG)
    config = dataclasses.replace(run.model, untie_embeddings_and_output_weights=False)
    torch.manual_seed(0)
    stage = GPTStage(GPTModel(config), 1, 2, pre_process=False, post_process=True,
                     tied_across_stages=True)
    apply_fp8(stage, run.fp8, torch.device("cpu"))
    assert stage.output_fp8 is not None and stage.shared_output_weight is not None
    seen = []
    gemm = stage.output_fp8
    stage.output_fp8 = lambda x, w, b: seen.append(w._base) or gemm(x, w, b)
    tokens = torch.randint(0, 97, (2, 16))
    stage(torch.randn(16, 2, 32), tokens, labels=tokens).sum().backward()
    assert seen == [stage.shared_output_weight]
    assert stage.shared_output_weight.grad[:97].abs().sum() > 0


@pytest.mark.parametrize("flags,says", [
    ("--fp8-output-proj", "--fp8-output-proj must be used together with --fp8-format"),
    ("--fp8-format e4m3 --fp8-recipe blockwise --fp8-output-proj",
     "--fp8-output-proj requires --fp8-recipe mxfp8, got 'blockwise'"),
    ("--fp8-format e4m3 --fp8-output-proj", "requires --fp8-recipe mxfp8, got 'delayed'"),
    (f"{FLAG} --tied", "--fp8-output-proj with tied embeddings on one pipeline stage"),
])
def test_megatrons_rules_are_one_line(capsys, flags, says):
    from tests.flags import parse_error

    base = TIED if "--tied" in flags else TINY_MOE
    err = parse_error(capsys, f"{base} --train-iters 1 {flags.replace(' --tied', '')}", 1)
    assert says in err, err


def test_tied_embeddings_are_accepted_over_pipeline_stages():
    """As Megatron: tied embeddings with the flag run under PP (the last stage owns the
    copy it multiplies); the planner's layout search keeps the rule (no PP1 layout)."""
    args = parse_args(shlex.split(f"{TIED} --train-iters 1 {FLAG} "
                                  "--pipeline-model-parallel-size 2"), world_size=2)
    run = run_config_from_args(args, 97)
    assert run.fp8.output_proj and not run.model.untie_embeddings_and_output_weights
    lay = lambda pp: Layout(tp=1, pp=pp, vpp=1, ep=1, etp=1, dp=1, cp=1,
                            distributed_optimizer=False, recompute="none",
                            micro_batch_size=2)
    assert layout_run(run.model, lay(2), 2, 8, run.fp8) is not None
    assert layout_run(run.model, lay(1), 1, 8, run.fp8) is None


def test_te_path_runs_the_head_on_tes_linear_under_mxfp8():
    """--transformer-impl transformer_engine: the head (and the MTP head) on TE's Linear
    under the run's MXFP8BlockScaling autocast, computing with the output layer's own
    weight; the stand-in's fp32 math gives the local high-precision head's logits and
    gradients (padded rows multiplied, then dropped: their gradient is zero)."""
    te_flags = "--transformer-impl transformer_engine --mtp-num-layers 1"
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    with installed() as te:
        flagged = build_model(_run(f"{te_flags} {FLAG}"))
        plain = build_model(_run(f"{te_flags} {MX}"))
        assert flagged.output_fp8.module.weight is flagged.output_layer.weight
        out = []
        for model in (flagged, plain):
            te.CALLS.clear()
            logits = model(tokens)
            model(tokens, labels=tokens).sum().backward()
            out.append((logits.detach(), model.output_layer.weight.grad,
                        [c for c, r in te.CALLS if type(r).__name__ == "MXFP8BlockScaling"]))
    # the logits-only forward runs the LM head (MTP runs with labels only), the forward
    # with labels the LM head and the MTP head
    assert len(out[0][2]) == len(out[1][2]) + 3
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-5, atol=1e-7)
    assert not bool(out[0][1][97:].any())


def _fp8_bytes_kept(model) -> int:
    """The FP8 bytes autograd keeps in one forward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    tokens = torch.randint(0, 97, (2, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=tokens).sum().backward()
    return sum(seen.values())


def test_planner_counts_the_head_in_fp8():
    """FP8 FLOPs grow by exactly the head's 6 V H per prediction (LM + MTP heads); the
    FP8 copies by what the head's autograd keeps (saved-tensor hooks on a forward of the
    built model: per head, the hidden states and the real-vocabulary weight rows in FP8;
    without MTP the whole count is exact, with MTP its growth: the MTP layers' own GEMMs
    are not counted either way); the dry run counts one more GEMM."""
    for mtp in ("", "--mtp-num-layers 1"):
        runs = [_run(f"{MX} {mtp} {f}") for f in ("", "--fp8-output-proj")]
        heads = 2 if mtp else 1
        flops = [fp8_gemm_flops_per_token(r.model, r.recompute, r.fp8) for r in runs]
        assert flops[1] - flops[0] == 6 * 97 * 32 * heads
        kept = []
        for run in runs:
            model = build_model(run)
            seen = _fp8_bytes_kept(model)
            planned = fp8_copy_bytes(run, model, with_scales=False)
            assert seen == planned or mtp
            kept.append((seen, planned, fp8_report(run, model)["gemms"]))
        grown = heads * (32 * 32 + 97 * 32)  # tokens x H + real rows x H, per head
        assert kept[1][0] - kept[0][0] == kept[1][1] - kept[0][1] == grown
        assert kept[1][2] == kept[0][2] + 1


def _losses(extra: str, world_size: int = 1) -> list[float]:
    args = parse_args(shlex.split(f"{TINY_MOE} {MX} --train-iters 4 {extra}"),
                      world_size=world_size)
    return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


def _layout_worker(rank: int, world_size: int, extra: str) -> list[float]:
    return _losses(f"--fp8-output-proj {extra}", world_size)


@pytest.mark.slow
@pytest.mark.parametrize("extra,bound", [
    ("--tensor-model-parallel-size 2 --sequence-parallel", 2e-4),
    ("--pipeline-model-parallel-size 2", 1e-5),
])
def test_parallel_layouts_match_one_process(extra, bound):
    """TP2+SP and PP2 (the head on the last stage) against one process, both with the
    flag, 4 steps. TP2: the bound of tests/training/test_fp8_training.py's MXFP8 layouts
    (the row-parallel GEMMs' tiles change with TP; the head's do not: 64 rows per rank are
    two whole 1x32 vocabulary tiles); PP2 runs the same GEMMs (fp32 rounding). The flag's
    own effect on the loss (measured 7.6e-5 relative) is above PP2's bound, so a stage
    whose head ignored it would fail; under TP that is shown per token by
    test_tensor_parallel_head_is_the_single_process_head."""
    from tests.distributed import run_distributed

    single = _losses("--fp8-output-proj")
    if bound < 1e-4:
        plain = _losses("")
        assert max(abs(a - b) / a for a, b in zip(single, plain)) > 2 * bound, (single, plain)
    ranks = run_distributed(_layout_worker, 2, 300, extra)
    for losses in ranks if "tensor" in extra else ranks[1:]:
        assert max(abs(a - b) / a for a, b in zip(single, losses)) < bound, (single, losses)


def _tp_head_worker(rank: int, world_size: int) -> list[float]:
    """One TP rank's head (SP: its sequence shard in, its vocabulary rows) against the
    single-process head on the same inputs, both in MXFP8: the largest relative
    differences of the per-token loss, dh (this rank's shard) and dW (its rows); and the
    loss's difference from the high-precision head (the test's sensitivity)."""
    run = _run(FLAG)
    gemm = Fp8Gemm(Fp8State(run.fp8).new_scaling("output_layer", 1, torch.device("cpu")))
    torch.manual_seed(0)
    h, w = torch.randn(16, 2, 32), 0.05 * torch.randn(run.model.padded_vocab_size, 32)
    labels = torch.randint(0, 97, (2, 16))
    tp = TensorParallel(group=dist.group.WORLD, sequence_parallel=True)

    def head(h_SBH, w_VH, t, g):
        h_SBH, w_VH = h_SBH.clone().requires_grad_(), w_VH.clone().requires_grad_()
        loss = lm_head(h_SBH, w_VH, labels, run.model, t, g)
        loss.sum().backward()
        return loss.detach(), h_SBH.grad, w_VH.grad

    ref, plain = head(h, w, SINGLE, gemm), head(h, w, SINGLE, None)
    got = head(h.chunk(2)[rank], w.chunk(2)[rank], tp, gemm)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
    return [rel(got[0], ref[0]), rel(got[1], ref[1].chunk(2)[rank]),
            rel(got[2], ref[2].chunk(2)[rank]), rel(plain[0], ref[0])]


def test_tensor_parallel_head_is_the_single_process_head():
    """TP2 + SP: each rank's MXFP8 head equals the single-process MXFP8 head to fp32
    summation order (1e-5 of the largest value): the same 1x32 tiles (along H per row and
    per token; along the vocabulary, 64 rows per rank are whole tiles) and the full
    gathered sequence. The high-precision head is 1e-3 or more away per token, so a TP
    path that skipped the FP8 GEMM would fail."""
    from tests.distributed import run_distributed

    for loss, dh, dw, plain in run_distributed(_tp_head_worker, 2, 120):
        assert loss < 1e-5 and dh < 1e-5 and dw < 1e-5, (loss, dh, dw)
        assert plain > 1e-3, plain
