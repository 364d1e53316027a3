"""Megatron-LM's default distributed-optimizer checkpoint layout (`dp_reshardable`: flat
per-bucket buffers) imported by convert.py megatron-to-megamoe, against real
megatron-core 0.19.2 (megatron_peer/peer_optim.py) as the oracle:

- the buffer layout function (megatron_dp_layout.bucket_layout) gives exactly the
  bucket lengths and parameter ranges megatron-core computed for itself (recorded in
  data/megatron_dp_layout_facts.json by the peer: MLA + MTP at DP 2 with
  --overlap-grad-reduce, a 40000-element bucket size and
  --ddp-pad-buckets-for-high-nccl-busbw, whose 20- and 24-element norms exercise the
  64-element parameter alignment; the slow test re-derives them from the peer);
- a DP 2 run (and DP 2 x EP 2, slow) saved in dp_reshardable after two real Adam steps
  and converted: the imported moments and fp32 main parameters equal megatron-core's
  own model-shaped (fully_reshardable) save of the same state, exactly (copies of the
  same numbers); resumed one iteration by megamoe (slow), its update is the AdamW step
  by hand (test_convert_megatron_optim.check_adamw_step) from that save;
- a layout the saved args do not describe: the one-line weights-only fallback.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import json
import os

import pytest
import torch

from tests.tools.megatron_peer.mcore_venv import run_peer
from tests.tools.test_convert_megatron_optim import (
    PEER_OPTIM,
    _raw,
    _resume_one_iteration,
    _resumed,
    check_adamw_step,
)
from tools.checkpoint.convert import main as convert

layout = importlib.import_module("megatron_dp_layout")
megatron_format = importlib.import_module("megatron_format")
reshard = importlib.import_module("megatron_dp_reshard")
FACTS = os.path.join(os.path.dirname(__file__), "data", "megatron_dp_layout_facts.json")


def _facts_of(buf: dict) -> dict:
    return {"bucket_size": None, "dp_size": buf["dp_size"],
            "buckets": [[b["numel"], b["numel_unpadded"],
                         [[n, s, e] for n, (s, e) in b["params"].items()]]
                        for b in buf["buckets"]]}


def _check_layout(fact: dict) -> None:
    """bucket_layout of megatron-core's parameters (registration order: the reverse of
    the order it filled its buckets in) gives its buckets and ranges exactly."""
    filled = [(n, e - s) for _, _, params in fact["buckets"] for n, s, e in params]
    got = layout.bucket_layout(filled[::-1], fact["bucket_size"], fact["dp_size"],
                               fact.get("pad_buckets_for_high_nccl_busbw", False))
    want = [(numel, unpadded, {n: (s, e) for n, s, e in params})
            for numel, unpadded, params in fact["buckets"]]
    assert [(b.numel, b.numel_unpadded, b.params) for b in got] == want


@pytest.mark.parametrize("case", ["mla_mtp_dp2_bucket40000_padbusbw",
                                  "mixtral_dp2_one_bucket"])
def test_layout_is_megatron_cores(case):
    _check_layout(json.load(open(FACTS))[case])


def _same_as_dump(ours: list, fact: dict) -> None:
    """The converter's buckets (rebuilt from the args and weights) are megatron-core's:
    same lengths, and each parameter (by megatron-core's own name in the rank's model
    chunk) at the same range. The converter names the norms by their checkpoint keys,
    the local spec's key map (`input_layernorm.weight` is saved as
    `self_attention.linear_qkv.layer_norm_weight`, `pre_mlp_layernorm.weight` as
    `mlp.linear_fc1.layer_norm_weight`), and an MTP depth's transformer layer by its
    legacy-file name (`transformer_layer`, megatron-core 0.19's `mtp_model_layer`)."""
    def module_name(key: str) -> str:
        return key.replace("self_attention.linear_qkv.layer_norm_weight",
                           "input_layernorm.weight").replace(
            "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight").replace(
            ".transformer_layer.", ".mtp_model_layer.")
    assert [(b.numel, b.numel_unpadded, [(module_name(e[0]), s, t)
                                         for e, (s, t) in b.params.items()])
            for b in ours] == [(n, u, sorted(map(tuple, params), key=lambda x: x[1]))
                               for n, u, params in fact["buckets"]]


def _save(tmp, mcore_python, *extra: str) -> tuple[str, str, str]:
    """(dp_reshardable save, fully_reshardable save of the same state, layout dump)."""
    out, ref, dump = str(tmp / "flat"), str(tmp / "ref"), str(tmp / "layout" / "l")
    run_peer(["--optimizer", "distrib", "--sharding", "dp_reshardable", "--dp", "2",
              "--out", out, "--reference-out", ref, "--layout-json", dump, *extra],
             python=mcore_python, script=PEER_OPTIM)
    return out, ref, dump


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, mcore_python):
    """A DP 2 Megatron save (2 gloo ranks, two Adam steps) in dp_reshardable, with its
    fully_reshardable twin and megatron-core's layout dump."""
    return _save(tmp_path_factory.mktemp("dp2"), mcore_python)


def _imported_equal_reference(conv: str, ref: str, spec: str = "local") -> None:
    """The converted moments and main params are megatron-core's own model-shaped ones
    (the same state saved twice by one process: equal exactly, being copies). With TP >
    1 Megatron pads the vocabulary (100 tokens) to a multiple of 128 x TP, megamoe to
    128 and carries the real rows only (zero padding): the padding rows are never looked
    up and not compared then."""
    p0, s0 = _raw(os.path.join(ref, "iter_0000002"))
    bf16 = p0["embedding.word_embeddings.weight"].dtype == torch.bfloat16  # (fp32 main)
    p1, s1, _, step = _resumed(os.path.join(conv, "iter_0000002"), bf16, spec)
    assert step == 2.0

    def same(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
        if got.shape != want.shape and key in ("embedding.word_embeddings.weight",
                                               "output_layer.weight"):
            got, want = got[:100], want[:100]
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=key)
    for name in ("exp_avg", "exp_avg_sq"):
        assert sorted(s1[name]) == sorted(s0[name])
        for key, t in s1[name].items():
            same(t, s0[name][key], key)
    # the fp32 main parameters (the non-distributed FP32Optimizer's are the weights)
    main0 = s0.get("param") or s0.get("fp32_param") or {k: p0[k] for k in s0["exp_avg"]}
    for key, t in main0.items():
        same(p1[key], t, key)


LINE = "Adam state of the distributed optimizer (dp_reshardable) at step 2"


def _convert(tmp, save: str, capsys, line: str = LINE) -> str:
    conv = str(tmp / "conv")
    assert convert(["megatron-to-megamoe", "--input", save, "--output", conv]) == 0
    assert line in capsys.readouterr().out
    return conv


def _convert_and_resume(tmp, save: str, ref: str, capsys, *run: str, line: str = LINE
                        ) -> None:
    conv = _convert(tmp, save, capsys, line)
    _imported_equal_reference(conv, ref)
    worst = check_adamw_step(ref, _resume_one_iteration(conv, str(tmp / "run"), *run))
    with capsys.disabled():
        print("worst errors (exp_avg_sq, update / lr):", worst)


def test_dp2_dp_reshardable_imports_megatron_cores_state(dp2, tmp_path, capsys):
    """The default-suite case: the layout from the args is megatron-core's and the
    imported moments and main parameters are its own model-shaped ones (the resumed
    AdamW step: the slow test below)."""
    save, ref, dump = dp2
    # the converter's layout (from the args and weights) is megatron-core's: same
    # bucket lengths, same parameter ranges
    fact = _facts_of(json.load(open(f"{dump}.rank0.json"))[0]["buffers"][0])
    _check_layout(fact)
    common, weights = megatron_format.read_megatron(os.path.join(save, "iter_0000002"))
    _same_as_dump(reshard.expected_buffers(common["args"], weights)[("", 0, 0)].buckets, fact)
    _imported_equal_reference(_convert(tmp_path, save, capsys), ref)


@pytest.mark.slow
def test_dp2_dp_reshardable_resumes_with_the_adamw_step(dp2, tmp_path, capsys):
    _convert_and_resume(tmp_path, dp2[0], dp2[1], capsys)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("--ep", "2"), ("--bf16",)])
def test_dp2_ep2_and_bf16_dp_reshardable(tmp_path, mcore_python, capsys, extra):
    """EP 2 (expert DP 1): megatron-core's ChainedOptimizer, the dense buffer under
    chained_0 (dp_group_idx_0), each EP rank's experts under chained_1.dp_group_idx_R;
    --bf16: bf16 buffers (dtype_(torch.bfloat16, torch.float32)), fp32 main params."""
    save, ref, _ = _save(tmp_path, mcore_python, *extra)
    _convert_and_resume(tmp_path, save, ref, capsys, *[e for e in extra if e == "--bf16"])


# TP / PP layouts: each (TP, PP) rank's own buffers, merged as the legacy weights are
TP_PP = {"tp2_pp2": ("--tp", "2", "--pp", "2"), "tp2_dp2": ("--tp", "2", "--dp", "2"),
         "pp2_dp2": ("--pp", "2", "--dp", "2"),
         "tp2_ep2_etp2": ("--tp", "2", "--ep", "2", "--etp", "2"),
         "tp2_ep2_etp1": ("--tp", "2", "--ep", "2", "--etp", "1"),
         # tied embeddings: each stage's copy in a bucket of its own (shared_embedding)
         "tied_pp2_dp2": ("--variant", "qk_norm", "--pp", "2", "--dp", "2"),
         # CP 2 x DP 2: the buffers sharded over the DP x CP group (4 ranks, dumped)
         "cp2_dp2": ("--cp", "2", "--dp", "2"),
         # a dense first layer (--moe-layer-freq [0,1,1]), gated shared experts, expert
         # bias: the layers saved one key per layer
         "dense_first_dp2": ("--variant", "shared_dense", "--dp", "2"),
         "dense_first_tp2_dp2": ("--variant", "shared_dense", "--tp", "2", "--dp", "2"),
         "dense_first_ep2": ("--variant", "shared_dense", "--ep", "2"),
         # MLA + two MTP depths (each an MoE layer) after the final norm, before the
         # output layer; with EP 2 the MTP experts in the expert buffers
         "mtp_dp2": ("--variant", "mla_mtp", "--dp", "2"),
         "mtp_ep2": ("--variant", "mla_mtp", "--ep", "2"),
         # MLA at TP 2 (--transformer-impl local: column-parallel down projections)
         "mla_mtp_tp2_dp2": ("--variant", "mla_mtp", "--tp", "2", "--dp", "2")}


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory, mcore_python):
    """A TP 2 x PP 2 Megatron save (4 gloo ranks, two Adam steps; the peer's pipeline is
    one micro-batch by hand) in dp_reshardable, with its fully_reshardable twin."""
    return _save(tmp_path_factory.mktemp("tp2pp2"), mcore_python, *TP_PP["tp2_pp2"])


def test_tp2_pp2_dp_reshardable_imports_megatron_cores_state(tp2_pp2, tmp_path, capsys):
    """The default-suite case for TP / PP: four ranks' buffers (dp_group_idx = tp + 2 pp,
    megatron-core's own numbering, checked against its dump) cut into each rank's TP
    slices of its stage's parameters and merged: megatron-core's model-shaped state
    exactly."""
    save, ref, dump = tp2_pp2
    common, weights = megatron_format.read_megatron(os.path.join(save, "iter_0000002"))
    ours = reshard.expected_buffers(common["args"], weights)
    for rank in range(4):
        (opt,) = json.load(open(f"{dump}.rank{rank}.json"))
        assert opt["dp_group_idx"] == opt["ranks"]["tp"] + 2 * opt["ranks"]["pp"]
        fact = _facts_of(opt["buffers"][0])
        _check_layout(fact)
        _same_as_dump(ours[("", opt["dp_group_idx"], 0)].buckets, fact)
    _imported_equal_reference(_convert(tmp_path, save, capsys), ref)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TP_PP))
def test_tp_pp_ep_dp_reshardable_resumes_with_the_adamw_step(case, tmp_path, mcore_python,
                                                            capsys):
    """TP 2 x PP 2, TP 2 x DP 2, PP 2 x DP 2, TP 2 x EP 2 with expert TP 2 (expert
    dp_group_idx = etp + 2 ep) and 1, CP 2 x DP 2 (the optimizer's group DP x CP, as
    megatron-core dumps it), a dense first layer at DP 2, TP 2 x DP 2 and EP 2, MLA with
    two MTP depths at DP 2, EP 2 and TP 2 x DP 2: the
    imported state is megatron-core's own model-shaped one and megamoe's first update
    from it is AdamW by hand."""
    save, ref, dump = _save(tmp_path, mcore_python, *TP_PP[case])
    _layouts_are_megatron_cores(save, dump)
    _convert_and_resume(tmp_path, save, ref, capsys)


def _layouts_are_megatron_cores(save: str, dump: str) -> int:
    """Every rank's every optimizer's buckets, as megatron-core dumped them, are the
    converter's (by dp_group_idx and chained prefix); returns how many were compared."""
    common, weights = megatron_format.read_megatron(os.path.join(save, "iter_0000002"))
    ours = reshard.expected_buffers(common["args"], weights)
    seen = 0
    for path in sorted(glob.glob(f"{dump}.rank*.json")):
        opts = json.load(open(path))
        for k, opt in enumerate(opts):
            prefix = f"chained_{k}." if len(opts) > 1 else ""
            _same_as_dump(ours[(prefix, opt["dp_group_idx"], 0)].buckets,
                          _facts_of(opt["buffers"][0]))
            assert ours[(prefix, opt["dp_group_idx"], 0)].dp_size == opt["buffers"][0][
                "dp_size"]
            seen += 1
    assert seen >= 2
    return seen


@pytest.mark.slow
def test_shared_experts_gate_after_its_linears_fails_the_check(tmp_path, mcore_python,
                                                              capsys, monkeypatch):
    """The breakage: a layer's keys taken in their saved order, SharedExpertMLP's
    gate_weight after its linear_fc1 / linear_fc2 (named_parameters puts a module's own
    parameters first): megatron-core's dump and its model-shaped save both disagree."""
    save, ref, dump = _save(tmp_path, mcore_python, *TP_PP["dense_first_dp2"])
    monkeypatch.setattr(reshard, "registration_order", lambda rests, te=False: rests)
    with pytest.raises(AssertionError):
        _layouts_are_megatron_cores(save, dump)
    _convert(tmp_path / "checked", save, capsys, line=MAIN_DIFFERS)
    _without_the_main_check(monkeypatch)
    conv = _convert(tmp_path, save, capsys)
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="shared_experts"):
        _imported_equal_reference(conv, ref)


@pytest.mark.slow
def test_mtp_layer_before_its_norms_fails_the_check(tmp_path, mcore_python, capsys,
                                                    monkeypatch):
    """The breakage: each MTP depth's transformer layer laid out before its enorm, hnorm
    and eh_proj (megatron-core registers it after them): the same lengths, so the
    converter cannot tell; megatron-core's dump and its model-shaped save can."""
    save, ref, dump = _save(tmp_path, mcore_python, *TP_PP["mtp_dp2"])
    real = reshard._mtp_depths

    def layer_first(*a):
        return [sorted(depth, key=lambda x: not x[2].startswith("transformer_layer."))
                for depth in real(*a)]
    monkeypatch.setattr(reshard, "_mtp_depths", layer_first)
    with pytest.raises(AssertionError):
        _layouts_are_megatron_cores(save, dump)
    _without_the_main_check(monkeypatch)
    conv = str(tmp_path / "conv")
    if convert(["megatron-to-megamoe", "--input", save, "--output", conv]) == 1:
        err = capsys.readouterr().err  # (garbage from the alignment gaps: refused)
        print(err)
        assert "mtp" in err
        return
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="mtp"):
        _imported_equal_reference(conv, ref)


# megatron_main_check's fallback: the main parameters read from the buffers are not the
# saved weights (each breakage below is first seen refused by the converter itself, then,
# with that check off, imported wrong and caught by the comparison with megatron-core)
MAIN_DIFFERS = "are not the saved weights"


def _without_the_main_check(monkeypatch) -> None:
    monkeypatch.setattr(megatron_format, "main_params_differ", lambda main, params: None)


def _glu_merged_as_columns(monkeypatch) -> None:
    """The breakage: the per-TP-rank [gate_r; up_r] halves of fc1's moments concatenated
    as plain column-parallel rows (the layout's swiglu flag dropped)."""
    real = reshard._layout

    def layout(args, **kw):
        found, dp = real(args, **kw)
        return dataclasses.replace(found, swiglu=False), dp
    monkeypatch.setattr(reshard, "_layout", layout)


@pytest.mark.slow
def test_a_tp_merge_without_the_swiglu_halves_fails_the_check(tp2_pp2, tmp_path, monkeypatch,
                                                              capsys):
    save, ref, _ = tp2_pp2
    _glu_merged_as_columns(monkeypatch)
    _convert(tmp_path / "checked", save, capsys, line=MAIN_DIFFERS)
    _without_the_main_check(monkeypatch)
    conv = _convert(tmp_path, save, capsys)
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="linear_fc1"):
        _imported_equal_reference(conv, ref)


@pytest.mark.slow
def test_recorded_facts_are_the_peers(tmp_path, mcore_python):
    """data/megatron_dp_layout_facts.json is what megatron-core computes today."""
    dump = str(tmp_path / "l")
    run_peer(["--variant", "mla_mtp", "--optimizer", "distrib", "--dp", "2",
              "--overlap-grad-reduce", "--bucket-size", "40000", "--pad-buckets",
              "--out", str(tmp_path / "x"), "--layout-json", dump, "--layout-only"],
             python=mcore_python, script=PEER_OPTIM)
    got = _facts_of(json.load(open(f"{dump}.rank0.json"))[0]["buffers"][0])
    want = json.load(open(FACTS))["mla_mtp_dp2_bucket40000_padbusbw"]
    assert got["buckets"] == want["buckets"] and got["dp_size"] == want["dp_size"]


def _forward_order(monkeypatch) -> None:
    """The buffer filled in registration order, not megatron-core's reverse."""
    real = layout.bucket_layout
    for module in (layout, reshard):
        monkeypatch.setattr(module, "bucket_layout", lambda p, *a: real(p[::-1], *a))


@pytest.mark.slow
def test_a_forward_parameter_order_fails_the_check(dp2, tmp_path, monkeypatch, capsys):
    """Same bucket length, other slices: the converter cannot tell, the comparison with
    megatron-core's own model-shaped save (and the layout facts) can."""
    save, ref, _ = dp2
    _forward_order(monkeypatch)
    _convert(tmp_path / "checked", save, capsys, line=MAIN_DIFFERS)
    _without_the_main_check(monkeypatch)
    conv = _convert(tmp_path, save, capsys)
    with pytest.raises(AssertionError):
        _check_layout(json.load(open(FACTS))["mixtral_dp2_one_bucket"])
    monkeypatch.undo()
    with pytest.raises(AssertionError) as e:
        _imported_equal_reference(conv, ref)
    print(str(e.value).splitlines()[0][:200])


@pytest.mark.parametrize("breakage", ["PARAM_ALIGN", "bucket_end_divisor"])
def test_dropped_padding_fails_the_layout_check(monkeypatch, breakage):
    """No 64-element parameter alignment, or no bucket-end padding: MLA's 20- and
    24-element norms and the 40000-element buckets no longer land where megatron-core
    put them."""
    if breakage == "PARAM_ALIGN":
        monkeypatch.setattr(layout, "PARAM_ALIGN", 1)
    else:
        monkeypatch.setattr(layout, "bucket_end_divisor", lambda dp, pad: 1)
    with pytest.raises(AssertionError):
        _check_layout(json.load(open(FACTS))["mla_mtp_dp2_bucket40000_padbusbw"])


@pytest.mark.slow
def test_a_layout_the_args_do_not_describe_falls_back(dp2, tmp_path, monkeypatch, capsys):
    """Saved bucket lengths that the rebuilt layout does not match (here: the args made
    to say 10000-element buckets): weights and schedule only, with one line why."""
    monkeypatch.setattr(reshard, "bucket_size_of", lambda *a: 10000)
    conv = str(tmp_path / "conv")
    assert convert(["megatron-to-megamoe", "--input", dp2[0], "--output", conv]) == 0
    out = capsys.readouterr().out
    assert "the distributed optimizer's 'dp_reshardable' layout is not rebuilt: " in out
    assert "fresh Adam moments" in out


def test_args_the_layout_does_not_model():
    """Untrusted args fields: what is not modelled is NotModelled (the fallback), a field
    of the wrong type a ConvertError naming it."""
    w = {"embedding.word_embeddings.weight": torch.zeros(8, 4),
         "decoder.layers.mlp.router.weight": torch.zeros(2, 4, 4),
         "decoder.layers.mlp.experts.experts.linear_fc1.weight": torch.zeros(2, 4, 6, 4),
         "output_layer.weight": torch.zeros(8, 4)}
    base = dict(data_parallel_size=2, expert_model_parallel_size=2, num_experts=4,
                num_layers=2)
    want = reshard.expected_buffers(argparse.Namespace(**base), w)
    assert sorted(want) == [("chained_0.", 0, 0), ("chained_1.", 0, 0), ("chained_1.", 1, 0)]
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert [e[1:3] for e in want[("chained_1.", 1, 0)].buckets[0].params][:2] == [
        (fc1, (1, 3)), (fc1, (1, 2))]
    assert want[("chained_1.", 1, 0)].files == [(0, 0, 1)]
    # TP 2 x PP 2: four dense buffers, each rank's halves of its stage's layer
    tp_pp = reshard.expected_buffers(argparse.Namespace(**{
        **base, "expert_model_parallel_size": 1, "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2, "untie_embeddings_and_output_weights": True}), w)
    assert sorted(tp_pp) == [("", 0, 0), ("", 1, 0), ("", 2, 0), ("", 3, 0)]
    assert [(e[0], e[3]) for e in tp_pp[("", 3, 0)].buckets[0].params][-1] == (
        "decoder.layers.0.mlp.router.weight", (4, 4))  # (replicated)
    assert [(e[0], e[3]) for e in tp_pp[("", 3, 0)].buckets[0].params][0] == (
        "output_layer.weight", (4, 4))  # (column-parallel)
    # PP 2 x 2 virtual stages (2 layers, one a chunk): each rank's chunks in gbuf order
    vpp = reshard.expected_buffers(argparse.Namespace(**{
        **base, "expert_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
        "num_layers": 4, "virtual_pipeline_model_parallel_size": 2}), {
        **w, **{k: torch.zeros(4, *w[k].shape[1:]) for k in w if ".layers." in k}})
    assert {k: b.chunk for k, b in vpp.items()} == {("", 0, 0): 0, ("", 0, 1): 1,
                                                    ("", 1, 0): 0, ("", 1, 1): 1}
    for bad in (dict(virtual_pipeline_model_parallel_size=3), dict(data_parallel_size=3),
                dict(moe_grouped_gemm=True, add_bias_linear=True),
                dict(data_parallel_size=None),
                dict(ddp_num_buckets=4), dict(num_distributed_optimizer_instances=2),
                dict(expert_tensor_parallel_size=2), dict(pipeline_model_parallel_size=3),
                dict(decoder_first_pipeline_num_layers=1, pipeline_model_parallel_size=2),
                dict(multi_latent_attention=True, tensor_model_parallel_size=2)):
        with pytest.raises(reshard.NotModelled):
            reshard.expected_buffers(argparse.Namespace(**{**base, **bad}), w)
    for bad in (dict(ddp_bucket_size="40000"), dict(data_parallel_size=0),
                dict(overlap_grad_reduce="yes"), dict(tensor_model_parallel_size=2**40),
                dict(pipeline_model_parallel_size=True), dict(context_parallel_size=0),
                dict(virtual_pipeline_model_parallel_size=0),
                dict(virtual_pipeline_model_parallel_size=2.0),
                dict(multi_latent_attention=True, kv_lora_rank="16")):
        with pytest.raises(reshard.ConvertError, match="args."):
            reshard.expected_buffers(argparse.Namespace(**{**base, **bad}), w)
