"""The legacy `--ckpt-format torch` optimizer state (the distributed optimizer's
`distrib_optim.pt` beside each rank's `model_optim_rng.pt`, and the non-distributed
optimizers' `optimizer` entry of that file) imported by convert.py megatron-to-megamoe,
against real megatron-core 0.19.2 (megatron_peer/peer_optim.py --format torch: two real
Adam steps of its DistributedOptimizer, then Megatron-LM's legacy save with
megatron-core's own `save_parameter_state`):

- the imported moments and fp32 main parameters equal megatron-core's own model-shaped
  (fully_reshardable torch_dist) save of the same state, exactly, and megamoe's first
  update from them is AdamW by hand (slow: TP 2 x PP 2, TP 2 x EP 2 x DP 2 with its
  folded rank files and a ChainedOptimizer's two-entry files, PP 2 x DP 2, CP 2 x DP 2);
- parameters laid out in forward order (same lengths) fail that comparison;
- a missing or crafted distrib_optim.pt: one line, exit 1, nothing written (the crafted
  fields without the peer, in the default set).
"""

from __future__ import annotations

import importlib
import os
import shutil

import pytest
import torch

from tests.tools.megatron_peer.mcore_venv import run_peer
from tests.tools.test_convert_megatron_dp_reshard import (
    _convert_and_resume,
    _imported_equal_reference,
)
from tests.tools.test_convert_megatron_optim import PEER_OPTIM
from tools.checkpoint.convert import main as convert

legacy_optim = importlib.import_module("megatron_legacy_optim")
reshard = importlib.import_module("megatron_dp_reshard")
checks = importlib.import_module("checks")

CASES = {"tp2_pp2": ("--tp", "2", "--pp", "2"), "tp2_ep2_dp2": ("--tp", "2", "--ep", "2",
                                                                "--dp", "2"),
         "pp2_dp2": ("--pp", "2", "--dp", "2"),
         "tied_pp2": ("--variant", "qk_norm", "--pp", "2"),
         # the buffers gathered over the DP x CP group (megatron-core's intra_dp_cp)
         "cp2_dp2": ("--cp", "2", "--dp", "2"),
         # a dense first layer, gated shared experts (each rank file's own parameter list)
         "dense_first_dp2": ("--variant", "shared_dense", "--dp", "2"),
         "mtp_dp2": ("--variant", "mla_mtp", "--dp", "2"),
         "mla_mtp_tp2": ("--variant", "mla_mtp", "--tp", "2")}
LINE = "Adam state of the distributed optimizer (distrib_optim.pt) at step 2"


def _save(tmp, mcore_python, *extra: str) -> tuple[str, str]:
    """(the legacy save, the same state saved as torch_dist model-shaped: the distributed
    optimizer's fully_reshardable, or the non-distributed one's)."""
    out, ref = str(tmp / "legacy"), str(tmp / "ref")
    run_peer(["--optimizer", "distrib", "--format", "torch", "--out", out,
              "--reference-out", ref, *extra], python=mcore_python, script=PEER_OPTIM)
    return out, ref


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory, mcore_python):
    return _save(tmp_path_factory.mktemp("legacy_tp2pp2"), mcore_python, *CASES["tp2_pp2"])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_legacy_distrib_optim_resumes_with_the_adamw_step(case, tmp_path, mcore_python,
                                                          capsys):
    save, ref = _save(tmp_path, mcore_python, *CASES[case])
    _convert_and_resume(tmp_path, save, ref, capsys, line=LINE)


NONDIST = {"fp32_tp2_pp2": ("--tp", "2", "--pp", "2"),
           "fp32_tp2_ep2_dp2": ("--tp", "2", "--ep", "2", "--dp", "2"),
           "bf16_pp2": ("--pp", "2", "--bf16"), "fp32_cp2_dp2": ("--cp", "2", "--dp", "2"),
           # virtual stages: each param group's parameters chunk after chunk
           "fp32_pp2_vpp2": ("--variant", "mixtral4", "--pp", "2", "--vpp", "2"),
           # MTP at PP 2: the last stage's copy of the embeddings in its optimizer too
           "fp32_mtp_pp2": ("--variant", "mla_mtp", "--pp", "2")}
NONDIST_LINE = "Adam state of the non-distributed optimizer (model_optim_rng.pt) at step 2"


@pytest.fixture(scope="module")
def fp32_vpp(tmp_path_factory, mcore_python):
    """The FP32Optimizer's legacy save at PP 2 x 2 virtual stages (the resume case and the
    chunk-order breakage share it)."""
    return _save(tmp_path_factory.mktemp("legacy_fp32_vpp"), mcore_python, "--optimizer",
                 "fp32", *NONDIST["fp32_pp2_vpp2"])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(NONDIST))
def test_legacy_nondistributed_optimizer_resumes_with_the_adamw_step(case, tmp_path,
                                                                    mcore_python, capsys,
                                                                    request):
    """model_optim_rng.pt's `optimizer` of FP32Optimizer (TP 2 x PP 2; TP 2 x EP 2 x DP 2:
    a ChainedOptimizer's [dense, expert] list in every file) and of Float16OptimizerWith
    Float16Params (--bf16, PP 2: its fp32_from_fp16_params, which carry megatron-core's
    tensor attributes): megatron-core's param-group order rebuilt, equal to its
    model-shaped save, and the AdamW step by hand."""
    save, ref = (request.getfixturevalue("fp32_vpp") if case == "fp32_pp2_vpp2" else
                 _save(tmp_path, mcore_python, "--optimizer", "fp32", *NONDIST[case]))
    _convert_and_resume(tmp_path, save, ref, capsys, *[e for e in NONDIST[case]
                                                       if e == "--bf16"], line=NONDIST_LINE)


@pytest.mark.slow
def test_a_shuffled_group_order_is_refused_or_fails(tmp_path, mcore_python, capsys,
                                                    monkeypatch):
    """The chunk's parameters taken in reverse order: the per-state shape checks refuse
    the file (one line), or the import differs from megatron-core's save."""
    save, ref = _save(tmp_path, mcore_python, "--optimizer", "fp32", *NONDIST["fp32_tp2_pp2"])
    real = legacy_optim._params
    monkeypatch.setattr(legacy_optim, "_params", lambda *a: real(*a)[::-1])
    conv = str(tmp_path / "conv")
    if convert(["megatron-to-megamoe", "--input", save, "--output", conv]) == 1:
        assert "is not a float tensor shaped" in capsys.readouterr().err
        return
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        _imported_equal_reference(conv, ref)


@pytest.mark.slow
def test_chunks_taken_in_reverse_are_refused_or_fail(fp32_vpp, tmp_path, capsys,
                                                     monkeypatch):
    """The breakage: a rank's model chunks taken last first (the param groups' order
    across virtual stages reversed): refused (a state not shaped as its parameter), or
    the import differs from megatron-core's save."""
    save, ref = fp32_vpp
    real = legacy_optim._rank_states

    def reversed_chunks(chunks, entry, args, experts, path, out, steps):
        backwards = {s: chunk[::-1] for s, chunk in out.items()}
        real(chunks[::-1], entry, args, experts, path, backwards, steps)
        for s in out:
            out[s][:] = backwards[s][::-1]
    monkeypatch.setattr(legacy_optim, "_rank_states", reversed_chunks)
    conv = str(tmp_path / "conv")
    if convert(["megatron-to-megamoe", "--input", save, "--output", conv]) == 1:
        assert "is not a float tensor shaped" in capsys.readouterr().err
        return
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        _imported_equal_reference(conv, ref)


@pytest.mark.slow
def test_forward_parameter_order_fails_the_check(tp2_pp2, tmp_path, monkeypatch, capsys):
    """The buffers filled in registration order instead of megatron-core's reverse: the
    same lengths (the converter cannot tell), other slices (the comparison can)."""
    save, ref = tp2_pp2
    real = legacy_optim.bucket_layout
    monkeypatch.setattr(legacy_optim, "bucket_layout", lambda p, *a: real(p[::-1], *a))
    conv = str(tmp_path / "conv")
    assert convert(["megatron-to-megamoe", "--input", save, "--output", conv]) == 0
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        _imported_equal_reference(conv, ref)


@pytest.mark.slow
def test_a_missing_distrib_optim_file_is_one_line(tp2_pp2, tmp_path, capsys):
    save = str(tmp_path / "copy")
    shutil.copytree(tp2_pp2[0], save)
    gone = os.path.join(save, "iter_0000002", "mp_rank_01_001", "distrib_optim.pt")
    os.remove(gone)
    out = str(tmp_path / "conv")
    assert convert(["megatron-to-megamoe", "--input", save, "--output", out]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and gone in err[0] and "missing" in err[0], err
    assert not os.path.exists(out)


def _state(n: int = 8) -> dict:
    return {"buckets_coalesced": True, 0: {(torch.float32, torch.float32): {
        "param": torch.zeros(n), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n),
        "numel_unpadded": n}}}


@pytest.mark.parametrize("bad, error", [
    (lambda s: s[0][(torch.float32, torch.float32)].update(numel_unpadded=-1), "numel"),
    (lambda s: s[0][(torch.float32, torch.float32)].update(numel_unpadded=True), "numel"),
    (lambda s: s[0][(torch.float32, torch.float32)].update(exp_avg=torch.zeros(7)), "exp_avg"),
    (lambda s: s[0][(torch.float32, torch.float32)].update(param=torch.zeros(8,
                                                           dtype=torch.int64)), "param"),
    (lambda s: s[0][(torch.float32, torch.float32)].update(exp_avg_sq="x"), "exp_avg_sq"),
    (lambda s: s.update({0: [1, 2]}), "one dtype"),
    (lambda s: s.update({1: s[0]}), "gradient buffers"),
    (lambda s: s.pop("buckets_coalesced"), "coalesced"),
])
def test_crafted_distrib_optim_fields_are_refused(bad, error):
    """Every field read from distrib_optim.pt is checked for type and range: a
    ConvertError (one line naming the file) or, for another format, NotModelled (the
    weights-and-schedule fallback)."""
    state = _state()
    assert legacy_optim._buffer(state, 0, False, "f.pt")[0]["numel_unpadded"] == 8
    bad(state)
    with pytest.raises((checks.ConvertError, reshard.NotModelled), match=error) as e:
        legacy_optim._buffer(state, 0, False, "f.pt")
    assert str(e.value).startswith("f.pt: ")
    with pytest.raises(checks.ConvertError, match="list of 2"):
        legacy_optim._buffer(_state(), 0, True, "f.pt")
    assert legacy_optim._buffer([None, _state()], 0, True, "f.pt") is None
    # two model chunks (virtual stages): buffers 0 and 1, each checked
    two = {**_state(), 1: _state(4)[0]}
    assert [b["numel_unpadded"] for b in legacy_optim._buffer(two, 0, False, "f.pt", 2)] == [
        8, 4]
    two[1][(torch.float32, torch.float32)]["numel_unpadded"] = 0
    with pytest.raises(checks.ConvertError, match="numel"):
        legacy_optim._buffer(two, 0, False, "f.pt", 2)
