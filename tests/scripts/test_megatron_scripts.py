"""Megatron-LM's own MoE scripts run unchanged: the flag lists held in
tests/fixtures/megatron_scripts (extracted by tools/megatron_scripts.py from a pinned commit)
equal a fresh extraction from a Megatron-LM checkout, and every conditional branch of each
script passes `--dry-run` with only paths changed, or stops with the one "not supported
yet" line the table below expects (the Megatron-FSDP branch of the DeepSeek-V3 script)."""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import subprocess

import pytest

from megamoe.cli import main as cli_main
from tests.scripts.test_launch_scripts import ROOT
from tools import megatron_scripts

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "megatron_scripts")
GIT_DIR = os.environ.get("MEGATRON_LM_GIT_DIR", "/work/.mirror/NVIDIA+Megatron-LM/repo")

# Paths the scripts take as arguments or environment: the only values the test changes.
PATHS = {"CHECKPOINT_PATH": "{tmp}/ckpt", "OUTPUT_PATH": "{tmp}/out", "DATA_PATH": "/data/c",
         "TOKENIZER_MODEL": "/cluster/tokenizer", "CHECKPOINT": "{tmp}/pretrained",
         "ENV_CONFIG": "{tmp}/env.yaml"}
PATH_FLAGS = {"--tokenizer-model": "/cluster/tokenizer", "--data-path": "/data/c"}
# The model-only configs (modelopt confs, the README) name no sizes of a run; these are
# the few flags a user adds to them, never one the script sets.
RUN = ["--train-iters", "10", "--lr", "1e-4"]
README_MODEL = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 "
                "--swiglu --normalization RMSNorm --position-embedding-type rope "
                "--tokenizer-type NullTokenizer").split()
# Flags of Megatron's RL and inference entry points (train_rl.py's GRPO loop and its
# inference engine), not of pretraining: a user drops them when launching pretrain_gpt.py.
RL_ONLY = {"--inference-max-seq-length": 1, "--inference-max-requests": 1,
           "--pretrained-checkpoint": 1, "--no-use-tokenizer-model-from-checkpoint-args": 0,
           "--tokenizer-hf-include-special-tokens": 0}

# modelopt's launchers pass the tokenizer and the output directory apart from the conf.
TOKENIZER = ["--tokenizer-model", "/cluster/tokenizer", "--save", "{tmp}/ckpt"]
FSDP = '[ "${USE_MEGATRON_FSDP}" = 1 ]'
# name -> (world size of the script's layout, vocabulary the tokenizer would give, extra
# flags, {condition that must be true (None: always): (expected refusal, the flags
# whose removal, with their values, must then let the dry run pass)}).
SCRIPTS = {
    # 8 GPUs per node; TP1 PP4 EP8 needs ETP x EP x PP = 32 ranks: 4 nodes.
    "mixtral_8x7b": (32, 32000, [], {}),
    # TP1 EP8, one node of 8 (GBS 2048 = MBS 4 x DP 8 x 64 micro-batches). The FSDP branch
    # is refused (Megatron-FSDP is not built); the profiling branch (an nsys range) passes.
    "deepseek_v3": (8, 129280, [], {FSDP: ("not supported yet: --use-megatron-fsdp", ())}),
    # TP4 EP2 without --sequence-parallel: megamoe refuses the layout (Megatron warns);
    # no flag of the script is refused.
    "qwen3_30b_a3b_rl": (8, 151936, RUN + ["--global-batch-size", "16"], {None: (
        "MoE with --tensor-model-parallel-size > 1 requires --sequence-parallel", ())}),
    "qwen3_30b_a3b": (8, 151936, TOKENIZER + RUN + ["--global-batch-size", "8"], {}),
    "deepseek_v2_lite": (8, 102400, TOKENIZER + RUN + ["--global-batch-size", "8"], {}),
    # Kimi-K2: every flag passes, its shared-expert overlap (alltoall dispatcher), its
    # tokenizer's own Python code (--trust-remote-code) and fixed --padded-vocab-size.
    "kimi_k2": (8, 163840, TOKENIZER + RUN + ["--global-batch-size", "8"], {}),
    # Its --tp-comm-overlap needs TP > 1 with --sequence-parallel (Megatron's assert; built
    # without Transformer Engine): the layout the test adds gives them, and every flag passes.
    "moe_readme_quick_start": (8, 32000, README_MODEL + RUN + [
        "--global-batch-size", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
                               {}),
}


def held(name: str) -> dict:
    with open(os.path.join(FIXTURES, f"{name}.json"), encoding="utf-8") as f:
        return json.load(f)


def _substitute(token: str, values: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        name, default = m.group(1) or m.group(3), m.group(2)
        return values.get(name, default if default is not None else "")
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", one, token)


def variants(record: dict) -> list[tuple[dict, list[str]]]:
    """Every combination of the script's `if` branches -> its command-line tokens, with
    the script's defaults and the test's paths substituted."""
    conditions = sorted({b["condition"] for b in record["blocks"] if b["condition"]})
    out = []
    for truth in itertools.product([False, True], repeat=len(conditions)):
        on = dict(zip(conditions, truth))
        arrays: dict[str, list[str]] = {}
        for b in record["blocks"]:
            if b["condition"] and not on[b["condition"]]:
                continue
            arrays[b["var"]] = (arrays.get(b["var"], []) if b["append"] else []) + b["tokens"]
        values = {**record["defaults"], **PATHS}
        tokens = [_substitute(t, values) for v in record["variables"]
                  for t in arrays.get(v, [])]
        out.append((on, tokens))
    return out


def launch_argv(tokens: list[str], tmp: str) -> list[str]:
    """Only paths change: tokenizer, data, output; RL-only flags are dropped."""
    argv, i = [], 0
    while i < len(tokens):
        t = tokens[i]
        if t in RL_ONLY:
            i += 1 + RL_ONLY[t]
            continue
        argv.append(t.replace("{tmp}", tmp))
        if t in PATH_FLAGS:
            argv.append(PATH_FLAGS[t])
            i += 1
        i += 1
    return argv


@pytest.mark.skipif(not os.path.isdir(GIT_DIR),
                    reason="no Megatron-LM checkout (fetch github:NVIDIA/Megatron-LM, or set "
                           "MEGATRON_LM_GIT_DIR) to re-extract the held scripts")
def test_held_scripts_equal_a_fresh_extraction():
    ok = subprocess.run(["git", "--git-dir", GIT_DIR, "cat-file", "-e",
                         megatron_scripts.COMMIT], capture_output=True)
    if ok.returncode != 0:
        pytest.skip(f"the checkout lacks the pinned commit {megatron_scripts.COMMIT}")
    fresh = megatron_scripts.extract(GIT_DIR)
    assert sorted(fresh) == sorted(os.path.basename(p)[:-5]
                                   for p in glob.glob(os.path.join(FIXTURES, "*.json")))
    for name, record in fresh.items():
        assert record == held(name), name


def test_every_branch_is_held():
    """The DeepSeek-V3 script's three `if`s (Megatron-FSDP, profiling, W&B) are all held,
    and a flag that only its FSDP branch passes is in the held data."""
    conds = {b["condition"] for b in held("deepseek_v3")["blocks"]}
    assert len(conds - {None}) == 3
    assert len(variants(held("deepseek_v3"))) == 8
    assert "--use-megatron-fsdp" in variants(held("deepseek_v3"))[-1][1]


def _dry_run(argv: list[str], world: int, vocab: int, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(cli_main.main(argv + ["--dry-run", "--json", "--vocab-size", str(vocab)]))
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for t in argv:
        if t.startswith("--"):
            skip = t in flags
        if not skip:
            out.append(t)
    return out


def _check_script(name: str, tmp_path, monkeypatch, capsys, only=None) -> int:
    """Dry-run every branch combination of `name` (or those `only(on)` keeps)."""
    world, vocab, extra, refusals = SCRIPTS[name]
    checked = 0
    for on, tokens in variants(held(name)):
        if only is not None and not only(on):
            continue
        argv = launch_argv(tokens + extra, str(tmp_path))
        code, out, err = _dry_run(argv, world, vocab, monkeypatch, capsys)
        expected = [r for cond, r in refusals.items() if cond is None or on.get(cond)]
        if expected:
            message, drop = expected[0]
            assert code == 2 and err.strip().endswith(message), (name, on, err)
            assert err.count("\n") == 1 and "Traceback" not in err
            if not drop:
                checked += 1
                continue
            code, out, err = _dry_run(_without(argv, drop), world, vocab, monkeypatch, capsys)
        assert code == 0, (name, on, err)
        assert json.loads(out.strip().splitlines()[-1])["parameters"] > 0
        checked += 1
    return checked


def test_deepseek_v3_script_dry_runs(tmp_path, monkeypatch, capsys):
    """The representative case: every non-FSDP flag (profiling and W&B branches on) passes,
    the FSDP branch is refused; the other combinations and scripts are in the slow set."""
    everything = lambda on: all(v for c, v in on.items() if c != FSDP)
    assert _check_script("deepseek_v3", tmp_path, monkeypatch, capsys, everything) == 2


def test_kimi_k2_script_dry_runs(tmp_path, monkeypatch, capsys):
    """Issue 28's leftovers: --moe-shared-expert-overlap and --trust-remote-code, refused
    before, pass (with them in the command line, not dropped)."""
    assert SCRIPTS["kimi_k2"][3] == {}
    tokens = variants(held("kimi_k2"))[0][1]
    assert {"--moe-shared-expert-overlap", "--trust-remote-code"} <= set(tokens)
    assert _check_script("kimi_k2", tmp_path, monkeypatch, capsys) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_dry_runs(name, tmp_path, monkeypatch, capsys):
    assert _check_script(name, tmp_path, monkeypatch, capsys) >= 1


def _deepseek_v3_argv(tmp_path) -> list[str]:
    """The held DeepSeek-V3 script's non-FSDP flags (profiling and W&B branches on)."""
    everything = [t for on, t in variants(held("deepseek_v3"))
                  if all(v for c, v in on.items() if c != FSDP)]
    return launch_argv(everything[0], str(tmp_path))


# DeepSeek-V3's 61 layers over a pipeline, as Megatron's recipes split them: the script's
# TP1 x EP8 node, times PP. (flags, world size, the refusal expected or None)
DEEPSEEK_PP = {
    # megatron/core/transformer/transformer_config.py's PP16 x VPP2 example, MTP with the loss
    "layout_pp16_vpp2": ('--pipeline-model-parallel-size 16 --pipeline-model-parallel-layout '
                         'Et*2|(tt|)*29,t|mL', 128, None),
    # pipeline_parallel_layout.md's layout puts MTP on a stage of its own: not built
    "documented_standalone_mtp": ('--pipeline-model-parallel-size 16 '
                                  '--pipeline-model-parallel-layout Et*3|(tt|)*29,m|L', 128,
                                  "not supported yet: --pipeline-model-parallel-layout with "
                                  "the MTP layers 'm' outside the last stage"),
    "first_last_pp8": ("--pipeline-model-parallel-size 8 --decoder-first-pipeline-num-layers 8 "
                       "--decoder-last-pipeline-num-layers 5", 64, None),
}


@pytest.mark.parametrize("case", sorted(DEEPSEEK_PP))
def test_deepseek_v3_script_with_uneven_pipeline_splits(case, tmp_path, monkeypatch, capsys):
    """The script plus Megatron's uneven split flags dry-runs (the per-rank memory is of
    the busiest stage of that split), or stops at the one line megamoe's limit gives."""
    flags, world, refusal = DEEPSEEK_PP[case]
    argv = _deepseek_v3_argv(tmp_path) + flags.split()
    code, out, err = _dry_run(argv, world, 129280, monkeypatch, capsys)
    if refusal is not None:
        assert code == 2 and refusal in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
        return
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["parameters"] > 0 and report["per_rank_memory_gib"] > 0
