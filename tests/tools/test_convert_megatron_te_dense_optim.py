"""Megatron-LM's default `--transformer-impl transformer_engine` in the distributed
optimizer's dp_reshardable layout, imported by convert.py megatron-to-megamoe, against
megatron-core 0.19.2's OWN TE spec (get_gpt_decoder_block_spec(use_transformer_engine=
True): input norm fused into linear_qkv, a dense MLP's pre-MLP norm into linear_fc1,
TENorm qk-layernorm and MoE pre_mlp_layernorm, TEDotProductAttention, TE Linear experts
or TEGroupedMLP) built on the peer's Transformer Engine stand-in
(megatron_peer/te_peer_stand_in/: TE 27486e03's constructor arguments and parameter
REGISTRATION ORDER, cited per module; plain torch math, NOT TE's kernels). These are the
"TE stand-in" cases, on the dense_qk variant (a dense first layer, a MoE layer,
qk-layernorm):

- DP 2 (SequentialMLP experts of TE Linear), DP 2 with --moe-grouped-gemm, TP 2 x EP 2
  (expert TP 1) and PP 2 x DP 2 with --moe-grouped-gemm; two real Adam steps: megatron-
  core's own buffer layout (its dump, every rank) is the converter's, the imported
  moments and fp32 main parameters equal megatron-core's own fully_reshardable save of
  the same state exactly (copies of the same numbers), megamoe's first update from them
  is AdamW by hand;
- the converter reading a TE save in the local spec's order (input_layernorm first): its
  main-parameter check refuses (weights and schedule), and with the check off the
  import fails (the moments read are other parameters' and the gaps' garbage: either
  the converter's own finite / non-negative check refuses them or the comparison with
  megatron-core's state fails).

- the TE and local orders of a dense layer's keys; MLA, MTP and other impls under the TE
  spec refused (weights and schedule); `--transformer-impl local` keeps the local order.

All slow (each save is a two- or four-rank peer run); nothing here is in the default suite.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import re

import pytest

from tests.tools.megatron_peer.mcore_venv import run_peer
from tests.tools.test_convert_megatron_dp_reshard import (
    _convert,
    _facts_of,
    _imported_equal_reference,
)
from tests.tools.test_convert_megatron_optim import (
    PEER_OPTIM,
    _resume_one_iteration,
    check_adamw_step,
)
from tools.checkpoint.convert import main as convert

megatron_format = importlib.import_module("megatron_format")
reshard = importlib.import_module("megatron_dp_reshard")
te_order = importlib.import_module("megatron_te_order")

pytestmark = pytest.mark.slow

CASES = {"dp2": (), "dp2_grouped": ("--moe-grouped-gemm",),
         "tp2_ep2_etp1_grouped": ("--moe-grouped-gemm", "--tp", "2", "--ep", "2",
                                  "--etp", "1"),
         "pp2_dp2_grouped": ("--moe-grouped-gemm", "--pp", "2")}


@pytest.fixture(scope="module", params=sorted(CASES))
def te_dense(request, tmp_path_factory, mcore_python):
    tmp = tmp_path_factory.mktemp(f"te_dense_{request.param}")
    out, ref, dump = str(tmp / "flat"), str(tmp / "ref"), str(tmp / "layout" / "l")
    run_peer(["--variant", "dense_qk", "--te-spec", "--optimizer", "distrib",
              "--sharding", "dp_reshardable", "--dp", "2", "--out", out,
              "--reference-out", ref, "--layout-json", dump, *CASES[request.param]],
             python=mcore_python, script=PEER_OPTIM, te_stand_in=True)
    return out, ref, dump


def _module_name(local: str, grouped: bool) -> str:
    """The converter's local name as megatron-core names the parameter in its TE model
    chunk: the fused norms keep their names (linear_qkv.layer_norm_weight), TEGroupedMLP's
    experts are `linear_fc1.weight{i}` (SequentialMLP's keep theirs)."""
    if not grouped:
        return local
    return re.sub(r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight",
                  r".experts.\2.weight\1", local)


def _layouts_are_megatron_cores(save: str, dump: str) -> int:
    """Every rank's every optimizer's buckets, as megatron-core dumped them from its TE
    model, are the converter's; returns how many compared."""
    common, weights = megatron_format.read_megatron(os.path.join(save, "iter_0000002"))
    assert common["args"].transformer_impl == "transformer_engine"
    ours = reshard.expected_buffers(common["args"], weights)
    grouped = getattr(common["args"], "moe_grouped_gemm", False)
    seen = 0
    for path in sorted(glob.glob(f"{dump}.rank*.json")):
        opts = json.load(open(path))
        for k, opt in enumerate(opts):
            fact = _facts_of(opt["buffers"][0])
            names = [n for _, _, ps in fact["buckets"] for n, _, _ in ps]
            assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names) or (
                len(opts) > 1 and k == 1)
            mine = ours[(f"chained_{k}." if len(opts) > 1 else "", opt["dp_group_idx"], 0)]
            assert mine.dp_size == opt["buffers"][0]["dp_size"]
            assert [(b.numel, b.numel_unpadded, [(_module_name(e[0], grouped), s, t)
                                                 for e, (s, t) in b.params.items()])
                    for b in mine.buckets] == [
                (n, u, sorted(map(tuple, ps), key=lambda x: x[1]))
                for n, u, ps in fact["buckets"]]
            seen += 1
    assert seen >= 2
    return seen


def test_te_stand_in_te_spec_dp_reshardable_is_megatron_cores_state(
        te_dense, tmp_path, capsys):
    """TE stand-in: megatron-core's whole TE spec: its layout is the converter's (the
    fused norms after linear_proj, first in their module), the import its own
    fully_reshardable state, the resumed update AdamW."""
    save, ref, dump = te_dense
    seen = _layouts_are_megatron_cores(save, dump)
    conv = _convert(tmp_path, save, capsys)
    _imported_equal_reference(conv, ref, spec="te")  # (TE's MoE pre_mlp_layernorm key)
    worst = check_adamw_step(ref, _resume_one_iteration(conv, str(tmp_path / "run")), "te")
    with capsys.disabled():
        print(f"TE stand-in TE spec, {seen} buffers, worst errors (exp_avg_sq, update / lr):",
              worst)


def test_te_stand_in_te_save_in_the_local_order_fails_the_check(
        te_dense, tmp_path, capsys, monkeypatch):
    """TE stand-in: the converter reading a TE spec save in the local spec's order (the
    input norm first, the pre-MLP norm before mlp): megatron-core's dump disagrees, the
    main-parameter check keeps weights and schedule only, and without that check the
    imported moments are other parameters' (and padding): refused or unequal."""
    save, ref, dump = te_dense
    monkeypatch.setattr(reshard, "te_dense_order", lambda *a: False)
    with pytest.raises(AssertionError):
        _layouts_are_megatron_cores(save, dump)
    _convert(tmp_path / "checked", save, capsys, line="are not the saved weights")
    monkeypatch.setattr(megatron_format, "main_params_differ", lambda main, params: None)
    conv = str(tmp_path / "conv")
    if convert(["megatron-to-megamoe", "--input", save, "--output", conv]) != 0:
        # (the moments read include the 64-element gaps' garbage: its validation refuses)
        assert "not a finite tensor" in capsys.readouterr().err
        return
    with pytest.raises(AssertionError):
        _imported_equal_reference(conv, ref, spec="te")


def test_the_te_and_local_orders_of_a_dense_layer():
    """A dense layer's keys as a TE save lists them: the local spec's order puts the
    fused norms in modules of their own ahead of self_attention / mlp, TE's keeps them in
    linear_qkv / linear_fc1, first there (LayerNormLinear's registration)."""
    saved = ["self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
             "self_attention.linear_qkv.layer_norm_weight", "self_attention.q_layernorm.weight",
             "mlp.linear_fc1.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc2.weight"]
    assert reshard.registration_order(saved, te=True) == [
        "self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight", "self_attention.q_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    assert reshard.registration_order(saved) == [
        "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
        "mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "mlp.linear_fc1.layer_norm_weight"]


@pytest.mark.parametrize("kw, mtp, why", [
    ({"multi_latent_attention": True}, False, "MLA"),
    ({}, True, "MTP"),
    ({"transformer_impl": "inference_optimized"}, False, "inference_optimized")])
def test_te_spec_layouts_not_checked_are_refused(kw, mtp, why):
    args = argparse.Namespace(**{"transformer_impl": "transformer_engine", **kw})
    with pytest.raises(reshard.NotModelled, match=why):
        te_order.te_dense_order(args, reshard._flag, reshard.NotModelled, mtp)


def test_the_local_impl_keeps_the_local_order_and_te_is_the_default():
    flag, refuse = reshard._flag, reshard.NotModelled
    local = argparse.Namespace(transformer_impl="local", multi_latent_attention=True)
    assert not te_order.te_dense_order(local, flag, refuse, True)
    assert te_order.te_dense_order(argparse.Namespace(), flag, refuse, False)
