"""The distributed optimizer's state with virtual pipeline stages and with MTP at PP > 1,
imported by convert.py megatron-to-megamoe from Megatron-LM's dp_reshardable torch_dist
save and its legacy distrib_optim.pt, against real megatron-core 0.19.2
(megatron_peer/peer_optim.py: its chunks, DDP and DistributedOptimizer, two real Adam
steps over a one-micro-batch pipeline run by hand, its own saves):

- virtual stages (PP 2 x 2 virtual stages x DP 2, 4 layers): one DDP buffer set per
  model chunk (`gbuf_idx` = the chunk, bucketing only in the first chunk), the chunks'
  layers interleaved (rank p's chunk v holds layer v * L/V + p * L/(PP V));
- MTP at PP 2 (MLA, a dense first layer, two MTP depths on the last stage): the last
  stage's own copy of the word embeddings, and both stages' embeddings in a bucket of
  their own (megatron-core's `shared_embedding` with MTP);

each: every rank's every buffer equals megatron-core's dump, the imported moments and
fp32 main parameters equal megatron-core's own fully_reshardable save of the same state
exactly, and megamoe's first update from them is AdamW by hand. One peer run writes the
torch_dist save, the legacy files and the oracle (module-scoped fixtures). All slow.
"""

from __future__ import annotations

import copy
import glob
import importlib
import json
import os

import pytest

from tests.tools.megatron_peer.mcore_venv import run_peer
from tests.tools.test_convert_megatron_dp_reshard import (
    MAIN_DIFFERS,
    _convert,
    _convert_and_resume,
    _facts_of,
    _imported_equal_reference,
    _same_as_dump,
    _without_the_main_check,
)
from tests.tools.test_convert_megatron_optim import PEER_OPTIM
from tools.checkpoint.convert import main as convert

megatron_format = importlib.import_module("megatron_format")
reshard = importlib.import_module("megatron_dp_reshard")
legacy_optim = importlib.import_module("megatron_legacy_optim")

LINES = {"flat": "Adam state of the distributed optimizer (dp_reshardable) at step 2",
         "legacy": "Adam state of the distributed optimizer (distrib_optim.pt) at step 2"}
CASES = {"vpp": ("--variant", "mixtral4", "--pp", "2", "--vpp", "2", "--dp", "2"),
         "mtp_pp2": ("--variant", "mla_mtp", "--pp", "2", "--dp", "2"),
         # EP 2 (expert DP 1): each chunk's dense buffer under chained_0 and its experts'
         # under chained_1 (gbuf_idx the chunk in both)
         "vpp_ep2": ("--variant", "mixtral4", "--pp", "2", "--vpp", "2", "--ep", "2")}


def _save(tmp, mcore_python, case: str) -> dict[str, str]:
    """{flat: dp_reshardable torch_dist, legacy: --ckpt-format torch, ref: the same state
    as fully_reshardable, dump: megatron-core's buffer layout} of one peer run."""
    out = {k: str(tmp / k) for k in ("flat", "legacy", "ref")}
    out["dump"] = str(tmp / "layout" / "l")
    run_peer(["--optimizer", "distrib", "--sharding", "dp_reshardable", "--out", out["flat"],
              "--legacy-out", out["legacy"], "--reference-out", out["ref"],
              "--layout-json", out["dump"], *CASES[case]], python=mcore_python,
             script=PEER_OPTIM)
    return out


@pytest.fixture(scope="module")
def vpp(tmp_path_factory, mcore_python):
    return _save(tmp_path_factory.mktemp("vpp"), mcore_python, "vpp")


@pytest.fixture(scope="module")
def mtp_pp2(tmp_path_factory, mcore_python):
    return _save(tmp_path_factory.mktemp("mtp_pp2"), mcore_python, "mtp_pp2")


def _buffers_are_megatron_cores(save: str, dump: str, **args) -> int:
    """Every rank's every optimizer's every buffer (gbuf_idx, its model chunk) as
    megatron-core dumped it is the converter's (from the save's weights and args, `args`
    overriding some); returns how many were compared."""
    common, weights = megatron_format.read_megatron(os.path.join(save, "iter_0000002"))
    saved = copy.copy(common["args"])
    vars(saved).update(args)
    ours = reshard.expected_buffers(saved, weights)
    seen = set()
    for path in sorted(glob.glob(f"{dump}.rank*.json")):
        opts = json.load(open(path))
        for k, opt in enumerate(opts):
            prefix = f"chained_{k}." if len(opts) > 1 else ""
            for g, buf in enumerate(opt["buffers"]):
                mine = ours[(prefix, opt["dp_group_idx"], g)]
                _same_as_dump(mine.buckets, _facts_of(buf))
                assert (mine.chunk, mine.dp_size) == (buf["chunk"], buf["dp_size"])
                seen.add((prefix, opt["dp_group_idx"], g))
    assert seen == set(ours), sorted(set(ours) ^ seen)
    return len(seen)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mtp_pp2", "vpp"])
@pytest.mark.parametrize("fmt", ["flat", "legacy"])
def test_imports_megatron_cores_state_and_resumes(case, fmt, vpp, mtp_pp2, tmp_path, capsys):
    saves = vpp if case == "vpp" else mtp_pp2
    if fmt == "flat":  # (2 ranks x 2 chunks, or 2 stages: 4 or 2 buffers)
        assert _buffers_are_megatron_cores(saves["flat"], saves["dump"]) == (
            4 if case == "vpp" else 2)
    _convert_and_resume(tmp_path, saves[fmt], saves["ref"], capsys, line=LINES[fmt])


@pytest.mark.slow
def test_vpp_ep2_imports_megatron_cores_state(tmp_path, mcore_python, capsys):
    """Virtual stages with EP 2: all 12 buffers (2 stages x 2 chunks dense, x 2 EP ranks
    experts) as megatron-core dumps them; both formats' import equal to its
    fully_reshardable save exactly (no resume: the AdamW check is the cases' above)."""
    saves = _save(tmp_path, mcore_python, "vpp_ep2")
    assert _buffers_are_megatron_cores(saves["flat"], saves["dump"]) == 12
    for fmt in ("flat", "legacy"):
        _imported_equal_reference(_convert(tmp_path / fmt, saves[fmt], capsys, LINES[fmt]),
                                  saves["ref"])


@pytest.mark.slow
def test_vpp_buckets_only_the_first_chunk(vpp, tmp_path, mcore_python):
    """With --overlap-grad-reduce and 40000-element buckets, megatron-core (as Megatron-LM's
    get_model builds it) splits only PP rank 0's first chunk into buckets; its dump
    (layout only: the overlap's hooks do not train on the CPU) is the converter's layout
    from the same model's args with those flags."""
    dump = str(tmp_path / "l")
    run_peer(["--optimizer", "distrib", "--overlap-grad-reduce", "--bucket-size", "40000",
              *CASES["vpp"], "--out", str(tmp_path / "x"), "--layout-json", dump,
              "--layout-only"], python=mcore_python, script=PEER_OPTIM)
    assert _buffers_are_megatron_cores(vpp["flat"], dump, overlap_grad_reduce=True,
                                       ddp_bucket_size=40000) == 4
    counts = [len(b["buckets"]) for r in (0, 2) for b in json.load(
        open(f"{dump}.rank{r}.json"))[0]["buffers"]]
    assert counts[0] > 1 and counts[1:] == [1, 1, 1], counts


def _swap_middle_chunks(monkeypatch) -> None:
    """The breakage: PP rank 0's second chunk (layer 2) and PP rank 1's first (layer 1)
    exchange their buffers: the same lengths, so the converter cannot tell."""
    real = reshard.merge_buckets

    def swapped(pieces, layout, where):
        at = {(ranks[0][1], chunk): i for i, (_, ranks, chunk, _) in enumerate(pieces)}
        a, b = at[(0, 1)], at[(1, 0)]
        pieces = list(pieces)
        (ba, ra, ca, fa), (bb, rb, cb, fb) = pieces[a], pieces[b]
        assert [x.numel_unpadded for x in (ba, bb)] == [bb.numel_unpadded, ba.numel_unpadded]
        pieces[a], pieces[b] = (ba, ra, ca, fb), (bb, rb, cb, fa)
        return real(pieces, layout, where)
    monkeypatch.setattr(reshard, "merge_buckets", swapped)
    monkeypatch.setattr(legacy_optim, "merge_buckets", swapped)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["flat", "legacy"])
def test_two_chunks_buffers_swapped_fail_the_check(fmt, vpp, tmp_path, capsys, monkeypatch):
    """(dp_reshardable: the converter's main-parameter check refuses it first; with that
    check off the comparison fails. distrib_optim.pt has no such check.)"""
    _swap_middle_chunks(monkeypatch)
    if fmt == "flat":
        _convert(tmp_path / "checked", vpp[fmt], capsys, MAIN_DIFFERS)
        _without_the_main_check(monkeypatch)
    conv = _convert(tmp_path, vpp[fmt], capsys, LINES[fmt])
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="decoder.layers."):
        _imported_equal_reference(conv, vpp["ref"])


@pytest.mark.slow
def test_mtp_embeddings_without_their_own_bucket_fail_the_check(mtp_pp2, tmp_path, capsys,
                                                                monkeypatch):
    """The breakage: the embeddings not given a bucket of their own (megatron-core's
    shared_embedding with MTP ignored): megatron-core's dump disagrees, and the saved
    dp_reshardable buckets do not match, so the converter keeps weights and schedule
    only. (distrib_optim.pt concatenates the buckets without their end padding, and the
    embeddings start at a multiple of 64 either way here: the same offsets there.)"""
    monkeypatch.setattr(reshard, "shared_embedding", lambda layout, mtp: frozenset())
    with pytest.raises(AssertionError):
        _buffers_are_megatron_cores(mtp_pp2["flat"], mtp_pp2["dump"])
    conv = str(tmp_path / "conv")
    assert convert(["megatron-to-megamoe", "--input", mtp_pp2["flat"], "--output", conv]) == 0
    out = capsys.readouterr().out
    assert "layout is not rebuilt" in out and "fresh Adam moments" in out, out
