"""--transformer-impl transformer_engine under tensor (+ sequence) parallelism, against the
TE stand-in (tests/te_stand_in: megamoe's fp32 math behind TE v2.18's signatures).

The TE modules run the local GEMMs inside megamoe's column/row-parallel layers; the fused
norm of a LayerNormLinear then runs inside the column-parallel region and its gradient is
partial over TP (summed by the gradient reduction: model/te/linears.py). Proof, on 2 gloo
ranks: after the gradient reduction, the TE model's loss, grad norm and every gradient
equal the local model's at the same layout, and its loss, grad norm and fused norms'
gradients equal TE's at TP1 (one process). A dense model at TP2 (LayerNorm with biases:
both fused-norm parameters) and a model with a dense and an MoE layer (shared experts,
routed experts split over ETP = TP = 2) at TP2+SP; multi-latent attention with both
latent norms fused, dense at TP2 (and with an MoE layer at TP2+SP: slow).

Tolerances: fp32 rounding. TE and local at the same layout run the same formulas, but
the fused norms' gradients are summed over TP after their backward instead of before
(and under SP the norm runs on the gathered sequence); TP1 sums in yet another order.
1e-5 relative, as the other layout tests (measured on this CPU: the largest gradient
difference 5.2e-7 of its tensor's largest value TE vs local, 8.8e-7 for the fused norms
vs TP1; losses equal, grad norms within 1e-7)."""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config.fp8 import Fp8Config
from megamoe.model.te.apply import apply_transformer_engine
from megamoe.model.te.support import check_run
from megamoe.moe.losses import set_aux_loss_backward_scale
from megamoe.parallel.mesh import build_mesh
from megamoe.training.build import build_model
from megamoe.training.optim.grads import (
    local_grad_norm,
    model_parallel_grad_norm,
    reduce_gradients,
)
from tests.distributed import run_distributed
from tests.te_stand_in import installed
from tests.training.test_pretrain import TINY_MOE

TE = "--transformer-impl transformer_engine"
_MOE_FLAGS = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 "
              "--moe-grouped-gemm --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 ")
assert _MOE_FLAGS in TINY_MOE
# A dense model (no MoE: TP without SP is allowed), LayerNorm (weight and bias fused into
# LayerNormLinear), qkv biases; and a dense + an MoE layer with shared experts under SP.
# An MTP depth (eh_proj on TE's Linear, column-parallel) in the first; per-head q/k norms
# (megamoe's, TP-partial gradients) in the second.
DENSE = (TINY_MOE.replace(_MOE_FLAGS, "") + " --normalization LayerNorm --add-qkv-bias "
         "--ffn-hidden-size 40 --mtp-num-layers 1 --train-iters 1")
MOE = (f"{TINY_MOE} --moe-layer-freq ([0]+[1]) --moe-shared-expert-intermediate-size 32 "
       "--ffn-hidden-size 40 --qk-layernorm --train-iters 1")
# Multi-latent attention with q compression and --qk-layernorm (both latent norms fused
# into the up projections): a dense model at TP2 (the norms replicated, fed the whole
# sequence), and with an MoE layer at TP2+SP (slow).
_MLA_FLAGS = ("--multi-latent-attention --kv-lora-rank 8 --qk-head-dim 8 "
              "--qk-pos-emb-head-dim 4 --v-head-dim 6 --q-lora-rank 16 --qk-layernorm ")
MLA_DENSE = (TINY_MOE.replace(_MOE_FLAGS, "").replace("--group-query-attention ", "")
             + f" {_MLA_FLAGS} --ffn-hidden-size 40 --train-iters 1")
MLA_MOE = (TINY_MOE.replace("--group-query-attention ", "") + f" {_MLA_FLAGS} "
           "--moe-layer-freq ([0]+[1]) --ffn-hidden-size 40 --train-iters 1")
CASES = {"dense_tp2": (DENSE, "--tensor-model-parallel-size 2"),
         "moe_tp2_sp": (MOE, "--tensor-model-parallel-size 2 --sequence-parallel"),
         "mla_dense_tp2": (MLA_DENSE, "--tensor-model-parallel-size 2")}
SLOW_CASES = {"mla_moe_tp2_sp": (MLA_MOE, "--tensor-model-parallel-size 2 "
                                          "--sequence-parallel")}
RTOL = 1e-5


def _run(flags: str, world_size: int):
    return run_config_from_args(parse_args(shlex.split(flags), world_size=world_size), 97)


def fused_norms(model) -> dict[str, torch.nn.Parameter]:
    """The norm parameters TE fuses into LayerNormLinear (replicated over TP)."""
    out = {}
    for name, layer in enumerate(model.decoder.layers):
        norms = [("input_layernorm", layer.input_layernorm)] if layer.fused_input_norm else []
        if layer.fused_pre_mlp_norm:
            norms.append(("pre_mlp_layernorm", layer.pre_mlp_layernorm))
        attn = layer.self_attention
        if getattr(attn, "fused_latent_norms", False):  # MLA's, in its up projections
            norms += [(f"self_attention.{n}", getattr(attn, n))
                      for n in ("q_layernorm", "kv_layernorm")]
        for norm_name, norm in norms:
            for p_name, p in norm.named_parameters():
                out[f"decoder.layers.{name}.{norm_name}.{p_name}"] = p
    return out


def _step(model, mesh=None) -> dict:
    """One forward/backward on fixed tokens, the gradients reduced as training reduces
    them: loss, grad norm, every gradient, the fused norms' names."""
    set_aux_loss_backward_scale(1.0)  # (a process-wide scale an earlier run may have set)
    torch.manual_seed(1)
    tokens, labels = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    params, grads = [p for _, p in named], [p.grad for _, p in named]
    if mesh is None:
        norm = local_grad_norm(grads)
    else:
        reduce_gradients(grads, params, mesh.group("tp"), mesh.group("dp"))
        norm = model_parallel_grad_norm(grads, params, mesh.group("tp"), None,
                                        mesh.group("ep"), mesh.group("etp"))
    return {"loss": loss.item(), "grad norm": norm.item(),
            "grads": {n: g.clone() for n, g in zip([n for n, _ in named], grads)},
            "fused": sorted(fused_norms(model))}


def _amax_groups(flags: str, world_size: int, mesh) -> list[str]:
    """Which of the mesh's groups TE's autocast gets as its amax reduction group under
    delayed scaling, without and with --tp-only-amax-red (compared as objects: on 2 ranks
    every group has the same members)."""
    names = []
    for extra in ("", "--tp-only-amax-red"):
        run = _run(f"{flags} {TE} --fp8-format hybrid --fp8-recipe delayed {extra}",
                   world_size)
        with build_model(run, mesh).decoder.layers[0].quantization() as autocast:
            group = autocast.state[2]
        names.append(next(n for n in ("tp_dp_cp", "tp_cp", "tp") if mesh.group(n) is group))
    return names


def _overlap_refusal(flags: str, world_size: int, mesh) -> str:
    """What installing TE on a model whose TP linears run --tp-comm-overlap's collective
    matmul (which bypasses the GEMM hook) says, for a library caller (the CLI refuses it
    first: support.py)."""
    model = build_model(_run(f"{flags} --tp-comm-overlap", world_size), mesh)
    try:
        apply_transformer_engine(model, Fp8Config())
    except ValueError as e:
        return str(e)
    return "installed"


def _layout_worker(rank: int, world_size: int, cases: dict) -> dict:
    out, mesh = {}, None
    for key, (flags, layout) in cases.items():
        local = _run(f"{flags} {layout}", world_size)
        mesh = mesh or build_mesh(local.parallel, "gloo", torch.device("cpu"))
        with installed():
            te = _step(build_model(_run(f"{flags} {layout} {TE}", world_size), mesh), mesh)
            te["amax groups"] = _amax_groups(f"{flags} {layout}", world_size, mesh)
            if "--sequence-parallel" in layout:
                te["overlap"] = _overlap_refusal(f"{flags} {layout}", world_size, mesh)
        out[key] = {"local": _step(build_model(local, mesh), mesh), "te": te}
    return out


def _te_tp1(flags: str) -> dict:
    with installed():
        return _step(build_model(_run(f"{flags} {TE}", 1)))


def _check_layout(key: str, got: dict, tp1: dict) -> None:
    te, local = got["te"], got["local"]
    assert te.get("overlap", "-") in ("-", "not supported yet: --tp-comm-overlap with "
                                           "--transformer-impl transformer_engine")
    # Megatron's get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red)
    assert te["amax groups"] == ["tp_dp_cp", "tp_cp"], te["amax groups"]
    assert te["fused"] and te["fused"] == tp1["fused"], (te["fused"], tp1["fused"])
    assert te["grads"].keys() == local["grads"].keys()
    for name, g in local["grads"].items():  # TE = local at the same layout
        torch.testing.assert_close(te["grads"][name], g, rtol=1e-5, atol=1e-7,
                                   msg=f"{key} {name}")
    for k in ("loss", "grad norm"):  # = local at the layout and TE at TP1
        assert te[k] == pytest.approx(local[k], rel=RTOL), (key, k, te[k], local[k])
        assert te[k] == pytest.approx(tp1[k], rel=RTOL), (key, k, te[k], tp1[k])
    for name in tp1["fused"]:  # the fused norms' gradients: whole on every TP rank
        torch.testing.assert_close(te["grads"][name], tp1["grads"][name], rtol=RTOL,
                                   atol=1e-7, msg=f"{key} {name} (vs TE at TP1)")


def test_te_under_tensor_and_sequence_parallelism_matches_local_and_tp1():
    per_rank = run_distributed(_layout_worker, 2, 240, CASES)
    for key, (flags, _layout) in CASES.items():
        tp1 = _te_tp1(flags)
        for got in per_rank:
            _check_layout(key, got[key], tp1)
    assert all("overlap" in got["moe_tp2_sp"]["te"] for got in per_rank)


@pytest.mark.slow
def test_te_mla_under_sequence_parallelism_matches_local_and_tp1():
    per_rank = run_distributed(_layout_worker, 2, 240, SLOW_CASES)
    for key, (flags, _layout) in SLOW_CASES.items():
        tp1 = _te_tp1(flags)
        for got in per_rank:
            _check_layout(key, got[key], tp1)


def test_the_runs_checks_take_mla_under_tp_sp_and_cp():
    """(Until this change the TE path refused MLA at TP > 1 and every model at CP > 1.)"""
    for layout in ("--tensor-model-parallel-size 2 --sequence-parallel",
                   "--context-parallel-size 2"):
        check_run(_run(f"{MLA_MOE} {TE} {layout}", 2))
