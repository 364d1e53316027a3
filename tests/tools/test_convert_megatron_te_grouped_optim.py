"""`--moe-grouped-gemm` (TEGroupedMLP experts) in Megatron-LM's default distributed-
optimizer layout (dp_reshardable) imported by convert.py megatron-to-megamoe, against
megatron-core 0.19.2's own TEGroupedMLP on the peer's Transformer Engine stand-in
(megatron_peer/te_peer_stand_in/: TE's GroupedLinear signature and parameter
registration order, `weight0 .. weight{E-1}` per fc, cited from TE 27486e03; plain torch
math, NOT TE's kernels), in megatron-core's whole TE spec as Megatron-LM builds it with
`--transformer-impl transformer_engine` (the fused norms' order:
test_convert_megatron_te_dense_optim.py). These are the "TE stand-in" cases:

- DP 2 with EP 1 and EP 2, TP 2 x EP 2 (expert TP 1), PP 2 x DP 2, two real Adam
  steps: megatron-core's own buffer layout (its dump, every rank) is the converter's,
  the imported moments and fp32 main parameters equal megatron-core's own
  fully_reshardable save of the same state exactly (copies of the same numbers), and
  megamoe's first update from them is AdamW by hand;
- the converter with SequentialMLP's order, or with each fc's weight{i} reversed: its
  main-parameter check refuses (weights and schedule), and with that check off the
  comparison fails (the order is what the test proves);
- the grouped layouts not checked against megatron-core are refused (weights and
  schedule only), and `--transformer-impl local` keeps SequentialMLP's order
  (megatron-core's LocalSpecProvider builds SequentialMLP whatever the flag says).

All slow: each save is a two- or four-rank peer run (~90 s in all).
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

megatron_format = importlib.import_module("megatron_format")
reshard = importlib.import_module("megatron_dp_reshard")
grouped = importlib.import_module("megatron_grouped_experts")

pytestmark = pytest.mark.slow


def _save(tmp, mcore_python, *extra: str) -> tuple[str, str, str]:
    out, ref, dump = str(tmp / "flat"), str(tmp / "ref"), str(tmp / "layout" / "l")
    run_peer(["--optimizer", "distrib", "--sharding", "dp_reshardable", "--dp", "2",
              "--moe-grouped-gemm", "--out", out, "--reference-out", ref,
              "--layout-json", dump, *extra],
             python=mcore_python, script=PEER_OPTIM, te_stand_in=True)
    return out, ref, dump


CASES = {"ep1": (), "ep2": ("--ep", "2"),
         # TP 2 with expert TP 1 (megatron-core then hands TE no TP: explicit expert
         # comms), PP 2: each stage's layers
         "tp2_ep2_etp1": ("--tp", "2", "--ep", "2", "--etp", "1"),
         "pp2_dp2": ("--pp", "2")}


@pytest.fixture(scope="module", params=sorted(CASES))
def te_grouped(request, tmp_path_factory, mcore_python):
    return _save(tmp_path_factory.mktemp(f"te_grouped_{request.param}"), mcore_python,
                 *CASES[request.param])


_TE_NAME = re.compile(r"(.*\.experts\.)(linear_fc[12])\.weight(\d+)")


def _module_name(local: str) -> str:
    """The converter's local name (SequentialMLP's, for the legacy merge) as megatron-core
    names the parameter in its model chunk: TEGroupedMLP's `linear_fc1.weight{i}` (the TE
    spec's fused norms keep their names)."""
    return re.sub(r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight",
                  r".experts.\2.weight\1", local)


def _layouts_are_megatron_cores(save: str, dump: str) -> int:
    """Every rank's every optimizer's buckets, as megatron-core dumped them (its
    TEGroupedMLP's weight{i} names), are the converter's; returns how many compared."""
    common, weights = megatron_format.read_megatron(os.path.join(save, "iter_0000002"))
    assert common["args"].moe_grouped_gemm and common["args"].transformer_impl == (
        "transformer_engine")
    ours = reshard.expected_buffers(common["args"], weights)
    seen = 0
    for path in sorted(glob.glob(f"{dump}.rank*.json")):
        opts = json.load(open(path))
        for k, opt in enumerate(opts):
            fact = _facts_of(opt["buffers"][0])
            names = [n for _, _, ps in fact["buckets"] for n, _, _ in ps]
            assert any(_TE_NAME.fullmatch(n) for n in names) or len(opts) > 1
            # (no virtual stages: one buffer per optimizer, gbuf_idx 0)
            mine = ours[(f"chained_{k}." if len(opts) > 1 else "", opt["dp_group_idx"], 0)]
            assert mine.dp_size == opt["buffers"][0]["dp_size"]
            assert [(b.numel, b.numel_unpadded, [(_module_name(e[0]), s, t)
                                                 for e, (s, t) in b.params.items()])
                    for b in mine.buckets] == [
                (n, u, sorted(map(tuple, ps), key=lambda x: x[1]))
                for n, u, ps in fact["buckets"]]
            seen += 1
    assert seen >= 2
    return seen


def test_te_stand_in_grouped_gemm_dp_reshardable_is_megatron_cores_state(
        te_grouped, tmp_path, capsys):
    """TE stand-in: megatron-core's TEGroupedMLP at DP 2 (EP 1: one buffer per rank; EP 2:
    a ChainedOptimizer, each EP rank's experts under chained_1): its layout is the
    converter's, the import its own fully_reshardable state, the resumed update AdamW."""
    save, ref, dump = te_grouped
    _layouts_are_megatron_cores(save, dump)
    conv = _convert(tmp_path, save, capsys)
    _imported_equal_reference(conv, ref, spec="te")  # (TE's MoE pre_mlp_layernorm key)
    worst = check_adamw_step(ref, _resume_one_iteration(conv, str(tmp_path / "run")), "te")
    with capsys.disabled():
        print("TE stand-in grouped gemm, worst errors (exp_avg_sq, update / lr):", worst)


_TE_LOCAL = re.compile(r"(.*)local_experts\.(\d+)\.(linear_fc[12])\.weight")
grouped_order = grouped.te_grouped_order  # (the real one, before a test patches it)


def _reversed_experts(params: list[tuple]) -> list[tuple]:
    """TEGroupedMLP's order with each fc's weight{i} run backwards (a wrong order of the
    same lengths: only the values can tell)."""
    out = grouped_order(params)
    i = 0
    while i < len(out):
        m = _TE_LOCAL.fullmatch(out[i][0])
        if m is None:
            i += 1
            continue
        j = i
        while j < len(out) and (n := _TE_LOCAL.fullmatch(out[j][0])) and n.group(1, 3) == (
                m.group(1, 3)):
            j += 1
        out[i:j] = out[i:j][::-1]
        i = j
    return out


@pytest.mark.parametrize("wrong", ["sequential_order", "weights_reversed"])
def test_te_stand_in_grouped_gemm_in_another_order_fails_the_check(
        te_grouped, tmp_path, capsys, monkeypatch, wrong):
    """TE stand-in: the converter reading TEGroupedMLP's buffers in SequentialMLP's order
    (each expert's fc1 and fc2 together), or with each fc's weight{i} reversed (the same
    bucket lengths): its main-parameter check (megatron_main_check) sees that the main
    parameters read are not the saved weights and keeps weights and schedule only; without
    that check it imports other parameters' moments and the comparison with megatron-core's
    own state fails."""
    save, ref, _ = te_grouped
    monkeypatch.setattr(reshard, "te_grouped_order", (lambda ps: list(ps)) if wrong == (
        "sequential_order") else _reversed_experts)
    _convert(tmp_path / "checked", save, capsys, line="are not the saved weights")
    monkeypatch.setattr(megatron_format, "main_params_differ", lambda main, params: None)
    conv = _convert(tmp_path, save, capsys)
    with pytest.raises(AssertionError):
        _imported_equal_reference(conv, ref, spec="te")


def _args(**kw) -> argparse.Namespace:
    base = dict(moe_grouped_gemm=True, transformer_impl="transformer_engine",
                add_bias_linear=False)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, expert_tp, why", [
    ({"add_bias_linear": True}, 1, "add_bias_linear"),
    ({"moe_single_grouped_weight": True}, 1, "moe_single_grouped_weight"),
    ({"moe_use_legacy_grouped_gemm": True}, 1, "moe_use_legacy_grouped_gemm"),
    ({"transformer_impl": "inference_optimized"}, 1, "inference_optimized"),
    ({}, 2, "expert TP > 1")])
def test_grouped_layouts_not_checked_are_refused(kw, expert_tp, why):
    with pytest.raises(reshard.NotModelled, match=why):
        grouped.te_grouped_experts(_args(**kw), reshard._flag, reshard.NotModelled, expert_tp)


def test_grouped_gemm_with_the_local_impl_keeps_sequential_order():
    """megatron-core's LocalSpecProvider builds SequentialMLP whatever --moe-grouped-gemm
    says; without the flag nothing changes either."""
    flag, refuse = reshard._flag, reshard.NotModelled
    assert not grouped.te_grouped_experts(_args(transformer_impl="local"), flag, refuse, 2)
    assert not grouped.te_grouped_experts(_args(moe_grouped_gemm=False), flag, refuse, 2)
    assert grouped.te_grouped_experts(argparse.Namespace(moe_grouped_gemm=True), flag,
                                      refuse, 1)  # (Megatron-LM's default impl: TE)


def test_the_grouped_order_of_two_layers():
    seq = [("a.norm",)] + [(f"a.mlp.experts.local_experts.{e}.linear_fc{f}.weight",)
                           for e in range(3) for f in (1, 2)] + [("b.norm",)] + [
        (f"b.mlp.experts.local_experts.{e}.linear_fc{f}.weight",) for e in range(2)
        for f in (1, 2)]
    assert [p[0] for p in grouped.te_grouped_order(seq)] == ["a.norm"] + [
        f"a.mlp.experts.local_experts.{e}.linear_fc{f}.weight" for f in (1, 2)
        for e in range(3)] + ["b.norm"] + [
        f"b.mlp.experts.local_experts.{e}.linear_fc{f}.weight" for f in (1, 2)
        for e in range(2)]

