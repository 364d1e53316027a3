"""Megatron-LM's legacy `--ckpt-format torch` checkpoints in, against real megatron-core
(0.19.2, the peer venv of megatron_peer/mcore_venv.py) as the oracle.

peer_legacy.py runs a tiny megatron-core GPT MoE (local spec, GQA, SwiGLU) sharded over
gloo processes, writes every rank's `mp_rank_*/model_optim_rng.pt` as Megatron-LM's
save_checkpoint does, saves the same shards as torch_dist, and records the logits of a
TP1/PP1/EP1 megatron-core model that loaded the torch_dist copy (megatron-core's own
resharding, independent of megamoe's merge). megamoe converts the legacy files and must
give the same logits (fp32; max abs diff <= 1e-5 of the logits' scale: the same fp32
math in another order, on this CPU in this run), and carry the iteration, consumed
samples and LR schedule position. Bad input (a truncated rank file, a missing one, a
crafted pickle): one line, exit 1, nothing written.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from megamoe.training.checkpoint import build_single_process_model
from tests.tools.megatron_peer.mcore_venv import (
    PEER_LEGACY,
    run_peer,
)
from tests.tools.test_convert_megatron import (
    Payload,
    _assert_close,
    _fails_cleanly,
)
from tools.checkpoint.convert import main as convert

TOKENS = [[(7 * i + 3 * b + 1) % 100 for i in range(16)] for b in range(2)]
DEFAULT = ("mixtral", 2, 2, 2, 2, None)  # variant, TP, PP, EP, expert TP, virtual stages
RANK_FILE = os.path.join("iter_0000007", "mp_rank_01_001_001", "model_optim_rng.pt")


@pytest.fixture(scope="module")
def legacy_saves(tmp_path_factory, mcore_python):
    """(variant, tp, pp, ep, etp, vpp[, release]) -> a legacy Megatron-LM save directory."""
    root, made = tmp_path_factory.mktemp("megatron-legacy"), {}

    def get(case: tuple) -> str:
        if case not in made:
            variant, tp, pp, ep, etp, vpp, *release = case
            out = str(root / "-".join(map(str, case)))
            args = ["--variant", variant, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep),
                    "--etp", str(etp), "--out", out]
            args += ["--vpp", str(vpp)] if vpp else []
            args += ["--release"] if release else []
            run_peer(args, python=mcore_python, script=PEER_LEGACY)
            made[case] = out
        return made[case]
    return get


def _logits(ckpt_root: str) -> tuple[torch.Tensor, dict]:
    it = sorted(d for d in os.listdir(ckpt_root) if d.startswith("iter_"))[-1]
    model, common = build_single_process_model(os.path.join(ckpt_root, it))
    with torch.no_grad():
        return model.eval()(torch.tensor(TOKENS)), common


def _check_against_megatron(save: str, out: str, iteration: int = 7) -> None:
    assert convert(["megatron-to-megamoe", "--input", save, "--output", out]) == 0
    logits, common = _logits(out)
    _assert_close(logits, torch.load(os.path.join(save, "reference_logits.pt")))
    assert common["iteration"] == iteration
    assert common["consumed_train_samples"] == 8 * iteration
    assert common["scheduler"] == {"num_steps": 8 * iteration, "unit": "samples"}


def test_legacy_tp2_pp2_ep2_matches_megatron_core(legacy_saves, tmp_path, capsys):
    """TP2 x PP2 x EP2 with expert TP = TP (Megatron-LM's default; 8 processes): 8 rank
    files merged (dense and expert SwiGLU halves over TP, experts over EP, layers over PP),
    the vocabulary padded for TP2 (256 rows) cut back to megamoe's, and what travels."""
    save = legacy_saves(DEFAULT)
    assert sorted(os.listdir(os.path.join(save, "iter_0000007"))) == [
        f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2)
        for e in range(2)]
    capsys.readouterr()
    _check_against_megatron(save, str(tmp_path / "mm"))
    assert "weights and schedule only" in capsys.readouterr().out


def test_pretrain_load_of_a_legacy_save_says_convert(legacy_saves, capsys):
    """pretrain_gpt.py --load MEGATRON_LEGACY_SAVE: one line pointing at the converter."""
    from megamoe.cli.main import main

    capsys.readouterr()
    code = main(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "16", "--max-position-embeddings", "16",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "9",
                 "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", "100", "--load", legacy_saves(DEFAULT)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert "convert.py megatron-to-megamoe" in err and "iter_0000007" in err


def _copy(legacy_saves, tmp_path, case: tuple = DEFAULT) -> str:
    bad = str(tmp_path / "bad")
    shutil.copytree(legacy_saves(case), bad)
    return bad


def _convert_fails(capsys, bad: str, tmp_path, *needles: str) -> None:
    out = str(tmp_path / "out")
    _fails_cleanly(capsys, ["megatron-to-megamoe", "--input", bad, "--output", out], out,
                   *needles)


@pytest.mark.parametrize("cut", [64, "half"])
def test_truncated_rank_file(legacy_saves, tmp_path, capsys, cut):
    bad = _copy(legacy_saves, tmp_path)
    path = os.path.join(bad, RANK_FILE)
    size = os.path.getsize(path)
    os.truncate(path, size // 2 if cut == "half" else size - cut)
    _convert_fails(capsys, bad, tmp_path, RANK_FILE, "cannot be read")


def test_missing_rank_file(legacy_saves, tmp_path, capsys):
    bad = _copy(legacy_saves, tmp_path)
    os.remove(os.path.join(bad, RANK_FILE))
    _convert_fails(capsys, bad, tmp_path, f"{RANK_FILE}: missing", "TP 2 x PP 2 x EP 2")
    shutil.rmtree(os.path.join(bad, os.path.dirname(RANK_FILE)))
    _convert_fails(capsys, bad, tmp_path, f"{RANK_FILE}: missing")


def _rewrite(path: str, edit) -> None:
    state = torch.load(path, weights_only=False)  # the peer's own test file
    torch.save(edit(state), path)


def test_crafted_pickle_in_rank_file(legacy_saves, tmp_path, capsys):
    bad, marker = _copy(legacy_saves, tmp_path), str(tmp_path / "payload-ran")

    def edit(state):
        state["args"].trap = Payload(marker)
        return state
    _rewrite(os.path.join(bad, RANK_FILE), edit)
    _convert_fails(capsys, bad, tmp_path, RANK_FILE, "refused", "io.open")
    assert not os.path.exists(marker)


def test_rank_files_of_another_run(legacy_saves, tmp_path, capsys):
    """A rank file whose iteration or layout differs from rank 0's is refused."""
    bad = _copy(legacy_saves, tmp_path)

    def edit(state):
        state["iteration"] = 9
        return state
    _rewrite(os.path.join(bad, RANK_FILE), edit)
    _convert_fails(capsys, bad, tmp_path, RANK_FILE, "iteration 9 differs")


# ---------------------------------------------------------------- slow: the layout matrix

@pytest.mark.slow
@pytest.mark.parametrize("case", [
    ("mixtral", 2, 2, 2, 1, None),      # expert TP 1: ranks fold as tp0/ep0, tp1/ep1
    ("mixtral", 2, 1, 2, 2, None),      # expert weights split over TP, SwiGLU halves
    ("mixtral4", 1, 2, 2, 1, 2),        # interleaved: model0/model1 per pipeline rank
    ("shared_dense", 2, 1, 2, 1, None),  # dense layer, shared experts + gate, expert bias
    ("qk_norm", 2, 2, 1, 2, None, "release"),  # tied output across stages, q/k norms
], ids=lambda c: "-".join(map(str, c)))
def test_legacy_layouts_match_megatron_core(legacy_saves, tmp_path, case):
    save = legacy_saves(case)
    if "release" in case:
        assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == \
            "release"
    _check_against_megatron(save, str(tmp_path / "mm"))


@pytest.mark.slow
def test_missing_rank_file_expert_tp1(legacy_saves, tmp_path, capsys):
    """With expert TP 1 < TP Megatron-LM writes only tp0/ep0 and tp1/ep1 per stage: losing
    one leaves a TP rank (and an EP rank) of that stage in no file."""
    case = ("mixtral", 2, 2, 2, 1, None)
    bad = _copy(legacy_saves, tmp_path, case)
    assert sorted(os.listdir(os.path.join(bad, "iter_0000007"))) == [
        "mp_rank_00_000_000", "mp_rank_00_001_000", "mp_rank_01_000_001",
        "mp_rank_01_001_001"]
    shutil.rmtree(os.path.join(bad, os.path.dirname(RANK_FILE)))
    _convert_fails(capsys, bad, tmp_path,
                   os.path.join("iter_0000007", "mp_rank_01_001_*/model_optim_rng.pt: missing"))


RANK0 = os.path.join("iter_0000007", "mp_rank_00_000_000", "model_optim_rng.pt")


@pytest.mark.parametrize("field,value,needle", [
    ("decoder_first_pipeline_num_layers", 1, "uneven pipeline split is not supported yet"),
    ("expert_tensor_parallel_size", 4, "expert_tensor_parallel_size = 4 (TP 2): not supported"),
    ("tensor_model_parallel_size", -2, "args.tensor_model_parallel_size = -2: expected an "
                                       "integer"),
    ("pipeline_model_parallel_size", True, "args.pipeline_model_parallel_size = True"),
    ("num_layers", 3, "does not split evenly over PP 2"),
    ("checkpoint_version", 2.0, "checkpoint_version = 2.0: only 3.0"),
])
def test_unsupported_or_bad_layout_in_args(legacy_saves, tmp_path, capsys, field, value,
                                           needle):
    """Rank 0's args decide the layout: each value that cannot be read is one line naming
    the file and the field (checked for type and range: the file may come from anywhere)."""
    bad = _copy(legacy_saves, tmp_path)

    def edit(state):
        if field == "checkpoint_version":
            state[field] = value
        else:
            setattr(state["args"], field, value)
        return state
    _rewrite(os.path.join(bad, RANK0), edit)
    _convert_fails(capsys, bad, tmp_path, RANK0, needle)


def test_pre_megatron_core_names_are_refused(legacy_saves, tmp_path, capsys):
    bad = _copy(legacy_saves, tmp_path)

    def edit(state):
        state["model"] = {f"language_model.{k}": v for k, v in state["model"].items()}
        return state
    _rewrite(os.path.join(bad, RANK0), edit)
    _convert_fails(capsys, bad, tmp_path, RANK0, "language_model.*", "not supported yet")


def test_stray_rank_folder(legacy_saves, tmp_path, capsys):
    bad = _copy(legacy_saves, tmp_path)
    shutil.copytree(os.path.join(bad, os.path.dirname(RANK_FILE)),
                    os.path.join(bad, "iter_0000007", "mp_rank_02_001_001"))
    _convert_fails(capsys, bad, tmp_path, "mp_rank_02_001_001: not a rank of this layout")
