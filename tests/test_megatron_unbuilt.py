"""Every Megatron-LM flag parses: the ones megamoe does not build (config/megatron_unbuilt.txt,
generated from Megatron's parser by tools/dump_megatron_flags.py --unbuilt) parse with
Megatron's shape and end as one line, "not supported yet: --flag" (exit 2), or Megatron's
own message for the deprecated flags its validate_args rejects."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.arguments import build_parser, parse_args
from megamoe.cli.unbuilt_args import MEGATRON_REJECTS, UNBUILT_DEST, built_flags, refused_flags
from megamoe.config.megatron_unbuilt import UNBUILT, read_table
from megamoe.config.unsupported import is_built
from tests.test_extension_flags import BASE, megatron_flags


def test_table_is_megatrons_flags_megamoe_lacks():
    """One line per flag: exactly Megatron's flags (the fixture, from the same commit) that
    megamoe's parser does not build; a flag megamoe builds must leave the table."""
    flags = [row[0] for row in UNBUILT]
    assert len(flags) == len(set(flags))
    assert set(flags) == megatron_flags() - built_flags(build_parser()) - {"--help"}
    for flag, kind, nargs, typ, choices, _default, dest in UNBUILT:
        assert kind in ("store", "store_true", "store_false"), flag
        assert (nargs == 0) == (kind != "store") and nargs in (None, 0, "+", "*", "?", 3), flag
        assert typ in ((None,) if kind != "store" else ("int", "float", "str", "other")), flag
        assert choices is None or (isinstance(choices, list) and typ != "other"), flag
        assert isinstance(dest, str) and dest.isidentifier(), flag
        assert not is_built(flag), flag


def _sample(nargs, typ, choices, default) -> list[str]:
    """Words that parse to a value other than Megatron's default (two for a list flag)."""
    if choices:
        word = next(str(c) for c in choices if c != default and [c] != default)
    else:
        word = {"int": "7", "float": "0.375", "str": "x", "other": "x"}[typ]
        if word in (str(default), [default]):
            word = "8"
    return [word] * (nargs if isinstance(nargs, int) else 2 if nargs in ("+", "*") else 1)


def _parsed(words: list[str], nargs, typ) -> object:
    convert = {"int": int, "float": float}.get(typ, str)
    values = [convert(w) for w in words]
    return values if nargs in ("+", "*") or isinstance(nargs, int) else values[0]


def test_every_unbuilt_flag_parses_with_its_shape_and_is_refused():
    """One command line holding all of them, each with a non-default value: argparse must
    consume each flag's own words into its value (a list for nargs "+"/"*"/N), and every
    flag is refused."""
    argv, expected, values = [], [], {}
    for flag, kind, nargs, typ, choices, default, _ in UNBUILT:
        if kind == "store":
            words = _sample(nargs, typ, choices, default)
            argv += [flag, *words]
            values[flag] = _parsed(words, nargs, typ)
        elif default == (kind == "store_true"):
            continue  # (a --no-X whose default is already off: nothing to give)
        else:
            argv.append(flag)
            values[flag] = kind == "store_true"
        expected.append(flag)
    args = build_parser().parse_args(argv)
    assert {f: vars(args)[UNBUILT_DEST + f] for f in values} == values
    assert len(expected) > 550 and refused_flags(args) == expected
    # given at Megatron's default: nothing asked of megamoe that it lacks
    same = build_parser().parse_args(["--dist-ckpt-workers", "1", "--no-rl-partial-rollouts"])
    assert refused_flags(same) == []


@pytest.mark.parametrize("extra, line", [
    ("--adlr-autoresume-interval=5", "not supported yet: --adlr-autoresume-interval"),
    # megamoe's --exit-signal-handler is a prefix (no abbreviation matching either way)
    ("--exit-signal-handler-for-dataloader", "not supported yet: "
                                             "--exit-signal-handler-for-dataloader"),
    ("--save-params-interval 2", "not supported yet: --save-params-interval"),
    ("--model-parallel-size 2", MEGATRON_REJECTS["--model-parallel-size"]),
    ("--checkpoint-activations", MEGATRON_REJECTS["--checkpoint-activations"]),
])
def test_a_megatron_script_gets_one_line(extra, line, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(shlex.split(f"{BASE} {extra}"), world_size=1)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"pretrain_gpt.py: error: {line}\n"


def test_default_values_pass_and_leave_no_attribute():
    args = parse_args(shlex.split(f"{BASE} --dist-ckpt-workers 1"), world_size=1)
    assert not [k for k in vars(args) if k.startswith(UNBUILT_DEST)]
    assert "--exit-signal-handler" in built_flags(build_parser())
    assert args.exit_signal_handler is False  # the unbuilt longer flag did not set it


def test_a_malformed_table_line_names_the_file_and_line(tmp_path):
    table = tmp_path / "t.txt"
    table.write_text("# header\n('--a', 'store', None, 'int', None, 1, 'a')\n"
                     "('--b', 'store', None, 'int', None, 1, '__import__(\"os\")')\n")
    with pytest.raises(ValueError, match=r"t.txt:3: not a \(flag, action"):
        read_table(str(table))
    table.write_text("('--a', 'store', None, 'int', None, 1, 'a')\nos.system('x')\n")
    with pytest.raises(ValueError, match=r"t.txt:2: "):
        read_table(str(table))
    assert len(UNBUILT) > 550
