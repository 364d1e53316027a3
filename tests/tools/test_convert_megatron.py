"""Megatron-LM torch_dist checkpoints in and out, against real megatron-core (0.19.2, in a
venv of its own: megatron_peer/mcore_venv.py) as the oracle:

- megatron-to-megamoe: megamoe's logits on the converted checkpoint equal megatron-core's
  on the same tokens (fp32; max abs diff <= 1e-5 of the logits' scale: the same fp32 math
  in another order, on this CPU in this run), and the iteration, consumed samples and LR
  schedule position travel;
- megamoe-to-megatron: the round trip is bitwise on every tensor, and (slow set)
  megatron-core's own dist_checkpointing.load of it gives the same logits;
- bad input (truncated shard, an unsupported args field, a crafted pickle): one line,
  exit 1, nothing written.

The peer venv is built on first use (minutes) and cached; where it cannot be built the
tests skip with the reason, except under CI=true, where that is a failure.
"""

from __future__ import annotations

import importlib
import math
import os
import shutil

import pytest
import torch

from megamoe.training.checkpoint import build_single_process_model
from tests.tools.megatron_peer.mcore_venv import run_peer
from tools.checkpoint.convert import main as convert

# tools/checkpoint/megatron_format.py, as convert.py imports it (its folder on sys.path)
megatron_format = importlib.import_module("megatron_format")

TOKENS = [[(7 * i + 3 * b + 1) % 100 for i in range(16)] for b in range(2)]
VOCAB = 100  # the peer's args.vocab_size (its padded vocabulary is 128)


def _logits(ckpt_root: str) -> torch.Tensor:
    it = sorted(d for d in os.listdir(ckpt_root) if d.startswith("iter_"))[-1]
    model, _ = build_single_process_model(os.path.join(ckpt_root, it))
    with torch.no_grad():
        return model.eval()(torch.tensor(TOKENS))


def _assert_close(logits: torch.Tensor, ref: torch.Tensor) -> None:
    ref = ref[..., :VOCAB]
    assert logits.shape == ref.shape
    diff, scale = (logits - ref).abs().max().item(), ref.abs().max().item()
    assert diff <= 1e-5 * scale, (diff, scale)


def _to_megamoe(save: str, out: str, *extra: str) -> None:
    assert convert(["megatron-to-megamoe", "--input", save, "--output", out, *extra]) == 0


def _tensors(it_dir: str) -> dict[str, torch.Tensor]:
    return megatron_format.read_megatron(it_dir)[1]


def test_megatron_to_megamoe_logits_schedule_and_round_trip(saves, tmp_path):
    save = saves("mixtral")
    mm, back = str(tmp_path / "megamoe"), str(tmp_path / "back")
    _to_megamoe(save, mm)
    _assert_close(_logits(mm), torch.load(os.path.join(save, "reference_logits.pt")))
    _, common = build_single_process_model(os.path.join(mm, "iter_0000007"))
    assert common["iteration"] == 7 and common["consumed_train_samples"] == 56
    assert common["scheduler"] == {"num_steps": 56, "unit": "samples"}
    for spec in ("local", "te"):
        out = f"{back}-{spec}"
        assert convert(["megamoe-to-megatron", "--input", mm, "--output", out,
                        "--megatron-spec", spec]) == 0
        got, want = _tensors(f"{out}/iter_0000007"), _tensors(f"{save}/iter_0000007")
        if spec == "te":  # TE's MoE layers keep their pre-MLP norm apart
            want = {k.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"):
                    v for k, v in want.items()}
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
    common = megatron_format.read_megatron(f"{back}-local/iter_0000007")[0]
    assert common["iteration"] == 7 and common["args"].consumed_train_samples == 56
    assert common["opt_param_scheduler"]["num_steps"] == 56
    assert common["args"].num_query_groups == 2 and common["args"].moe_ffn_hidden_size == 80


def test_iteration_dir_input_and_flag_override(saves, tmp_path):
    """--input may name one iter_N directory; trailing pretrain_gpt.py flags override the
    saved args (here the dropout, which does not change the weights)."""
    out = str(tmp_path / "mm")
    _to_megamoe(os.path.join(saves("mixtral"), "iter_0000007"), out, "--hidden-dropout", "0.2")
    _, common = build_single_process_model(os.path.join(out, "iter_0000007"))
    assert common["model_config"]["hidden_dropout"] == 0.2


def test_use_checkpoint_args_takes_the_saved_shape(saves, tmp_path, capsys):
    """pretrain_gpt.py --use-checkpoint-args: the model's shape from the (converted)
    checkpoint, with Megatron's semantics: unset sizes are filled, forced fields win over
    the command line; without --load it is a flag error, without a checkpoint a file one."""
    from megamoe.cli.arguments import parse_args
    from megamoe.cli.mapping import run_config_from_args

    mm = str(tmp_path / "mm")
    _to_megamoe(saves("mixtral"), mm)
    run = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
           "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "9",
           "--lr", "1e-3", "--load", mm, "--use-checkpoint-args"]
    args = parse_args(run + ["--num-attention-heads", "8", "--num-experts", "8"], world_size=1)
    config = run_config_from_args(args, 100).model
    assert (config.num_layers, config.hidden_size, config.moe.ffn_hidden_size) == (2, 64, 80)
    assert config.num_attention_heads == 8  # set on the command line: not forced
    assert config.moe.num_experts == 4 and config.num_query_groups == 2  # forced
    with pytest.raises(SystemExit) as e:
        parse_args(run[:-3] + ["--use-checkpoint-args"], world_size=1)
    assert e.value.code == 2 and "--use-checkpoint-args needs --load" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_args(run[:-3] + ["--load", str(tmp_path / "none"), "--use-checkpoint-args"],
                   world_size=1)
    assert e.value.code == 1 and "no checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------- bad input

def _fails_cleanly(capsys, args: list[str], out: str, *needles: str) -> str:
    capsys.readouterr()
    assert convert(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert not os.path.exists(out)
    return err


def _rewrite_common(save: str, dst: str, edit) -> None:
    """A copy of `save` whose common state is `edit(common)` (tensors unchanged)."""
    common, tensors = megatron_format.read_megatron(os.path.join(save, "iter_0000007"))
    meta = megatron_format.read_dcp_metadata(os.path.join(save, "iter_0000007", ".metadata"))
    extra = [k for k in meta.state_dict_metadata if "_extra_state" in k]
    megatron_format.write_megatron(dst, 7, tensors, edit(common), extra)


@pytest.mark.parametrize("cut", [64, "half"])
def test_truncated_shard(saves, tmp_path, capsys, cut):
    """A few bytes short (DCP's read fails) or half (the index promises more bytes than
    the shards hold, refused before anything is allocated)."""
    bad = str(tmp_path / "bad")
    shutil.copytree(saves("mixtral"), bad)
    shard = os.path.join(bad, "iter_0000007", "__0_0.distcp")
    size = os.path.getsize(shard)
    os.truncate(shard, size // 2 if cut == "half" else size - cut)
    _fails_cleanly(capsys, ["megatron-to-megamoe", "--input", bad, "--output",
                            str(tmp_path / "out")], str(tmp_path / "out"), "iter_0000007")


def test_unsupported_args_field(saves, tmp_path, capsys):
    bad = str(tmp_path / "bad")

    def edit(common):
        common["args"].apply_layernorm_1p = True
        return common
    _rewrite_common(saves("mixtral"), bad, edit)
    _fails_cleanly(capsys, ["megatron-to-megamoe", "--input", bad, "--output",
                            str(tmp_path / "out")], str(tmp_path / "out"),
                   "args.apply_layernorm_1p", "not supported yet")


class Payload:
    """Unpickling this creates `marker`: any code a loader lets run would do the same."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_pickle_in_common_state(saves, tmp_path, capsys):
    bad, marker = str(tmp_path / "bad"), str(tmp_path / "payload-ran")

    def edit(common):
        common["args"].trap = Payload(marker)
        return common
    _rewrite_common(saves("mixtral"), bad, edit)
    _fails_cleanly(capsys, ["megatron-to-megamoe", "--input", bad, "--output",
                            str(tmp_path / "out")], str(tmp_path / "out"),
                   "refused", "io.open")
    assert not os.path.exists(marker)


# ---------------------------------------------------------------- slow: the other variants

@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mixtral", "shared_dense", "qk_norm", "squared_relu",
                                     "quick_geglu_interleaved"])
def test_variant_both_ways_through_megatron_core(saves, mcore_python, tmp_path, variant):
    """Converted in, out (local spec), and loaded by megatron-core's own
    dist_checkpointing.load: the same logits as the model that was saved."""
    save = saves(variant)
    ref = torch.load(os.path.join(save, "reference_logits.pt"))
    mm, back = str(tmp_path / "mm"), str(tmp_path / "back")
    _to_megamoe(save, mm)
    _assert_close(_logits(mm), ref)
    assert convert(["megamoe-to-megatron", "--input", mm, "--output", back,
                    "--megatron-spec", "local"]) == 0
    got = str(tmp_path / "logits.pt")
    run_peer(["load", "--variant", variant, "--ckpt", back, "--out", got], python=mcore_python)
    assert torch.equal(torch.load(got), ref)  # the same weights, the same program


@pytest.mark.slow
def test_pretrain_load_continues_where_megatron_stopped(saves, tmp_path):
    """pretrain_gpt.py --load of a converted checkpoint resumes after Megatron's iteration
    7 with Megatron's schedule position (56 samples): the LR logged for iteration 8 is,
    as in Megatron's log, the one after that step, at 56 + 8 samples."""
    from megamoe.cli.arguments import parse_args
    from megamoe.cli.main import pretrain

    mm = str(tmp_path / "mm")
    _to_megamoe(saves("mixtral"), mm)
    flags = megatron_format.flags_from_args(
        megatron_format.read_megatron(os.path.join(saves("mixtral"), "iter_0000007"))[0]["args"])
    args = parse_args(flags + ["--load", mm, "--train-iters", "9", "--lr-decay-iters", "20",
                               "--mock-data",
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                               "--num-workers", "0", "--eval-iters", "0", "--log-interval",
                               "1"], world_size=1)
    hist = pretrain(args, print_fn=lambda _m: None).history
    assert [h["iteration"] for h in hist] == [8, 9]
    ratio = (64 - 16) / (160 - 16)  # warm-up 2 x 8 samples, decay 20 x 8
    lr = 3e-5 + 0.5 * (math.cos(math.pi * ratio) + 1) * (3e-4 - 3e-5)
    assert hist[0]["lr"] == pytest.approx(lr, rel=1e-12)

