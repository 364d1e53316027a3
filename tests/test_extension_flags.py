"""megamoe's own flags say "megamoe extension" in --help, decided by which flags Megatron-LM's
parser has (tests/fixtures/megatron_flags.txt, dumped from NVIDIA/Megatron-LM d98e8a64 by
tools/dump_megatron_flags.py); a --config preset's on/off flag can be undone with its
negation (`bf16: true` + `--no-bf16` runs in fp32)."""

from __future__ import annotations

import os
import shlex

import pytest

from megamoe.cli.arguments import build_parser, parse_args
from megamoe.cli.extensions import MARK, MEGAMOE_EXTENSIONS, NegationAction
from megamoe.cli.mapping import run_config_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--mock-data --lr 1e-3 --train-iters 2")


def megatron_flags() -> set[str]:
    path = os.path.join(ROOT, "tests", "fixtures", "megatron_flags.txt")
    with open(path, encoding="utf-8") as f:
        return {ln.strip() for ln in f if ln.startswith("--")}


def _actions():
    return {s: a for a in build_parser()._actions for s in a.option_strings
            if s.startswith("--")}


def test_fixture_is_megatrons_parser():
    flags = megatron_flags()
    assert len(flags) > 800 and {"--num-experts", "--step-batch-size-schedule",
                                 "--null-tokenizer-eod-id", "--yaml-cfg"} <= flags


def test_extensions_are_exactly_the_flags_megatron_lacks():
    actions = _actions()
    negations = {f for f, a in actions.items() if isinstance(a, NegationAction)}
    assert set(actions) - megatron_flags() - negations == set(MEGAMOE_EXTENSIONS)
    assert not negations & megatron_flags()  # a negation never takes a Megatron name


def test_help_says_megamoe_extension_for_those_and_only_those():
    meg = megatron_flags()
    for flag, action in _actions().items():
        marked = (action.help or "").startswith(MARK)
        assert marked == (flag not in meg), (flag, action.help)
    text = build_parser().format_help()
    assert text.count(MARK) >= len(MEGAMOE_EXTENSIONS)


def test_negations_undo_their_flag():
    parser = build_parser()
    for flag, action in _actions().items():
        if not isinstance(action, NegationAction):
            continue
        original = next(a for a in parser._actions if a.dest == action.dest
                        and not isinstance(a, NegationAction))
        on = original.option_strings[0]
        assert getattr(parser.parse_args([on, flag]), action.dest) == original.default, flag
        assert getattr(parser.parse_args([flag, on]), action.dest) == original.const, flag
        assert getattr(parser.parse_args([]), action.dest) == original.default, flag


def test_preset_boolean_can_be_turned_off(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("bf16: true\nswiglu: true\nuse-cpu-initialization: true\n")
    on = parse_args(shlex.split(f"{BASE} --config {preset}"), world_size=1)
    off = parse_args(shlex.split(f"{BASE} --config {preset} --no-bf16 --no-swiglu"),
                     world_size=1)
    assert (on.bf16, on.swiglu) == (True, True) and (off.bf16, off.swiglu) == (False, False)
    assert off.use_cpu_initialization  # what is not undone stays
    run = run_config_from_args(off, 64)
    assert run.model.swiglu is False and run.optim.bf16 is False


@pytest.mark.parametrize("flag", ["--no-bf16", "--load-optim", "--position-embedding"])
def test_negation_is_listed_in_help(flag):
    assert flag in build_parser().format_help()
