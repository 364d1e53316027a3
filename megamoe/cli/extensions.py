"""What megamoe's command line adds to Megatron-LM's: its own flags, marked "megamoe
extension" in --help, and a negation of every on/off flag, so a --config preset's
`bf16: true` can be undone on the command line (`--no-bf16`).

Which flags Megatron-LM's parser has is recorded in tests/fixtures/megatron_flags.txt
(tools/dump_megatron_flags.py); tests/test_extension_flags.py checks this list against it.
"""

from __future__ import annotations

import argparse

MARK = "megamoe extension"

# Flags of megamoe's parser that Megatron-LM's pretrain_gpt.py does not have (the
# negations below are extensions too, marked where they are made).
MEGAMOE_EXTENSIONS = (
    "--config", "--dry-run", "--compile", "--ckpt-keep-last", "--peak-tflops",
    "--qk-layernorm-scope", "--moe-a2a-overlap-degree", "--moe-adaptive-parallelism",
    "--moe-capacity-over-tp-gathered-sequence", "--moe-expert-bias-counts-before-capacity",
    "--log-first-iterations", "--json",
    "--tp-only-amax-red",  # megatron-core's TransformerConfig field; no Megatron-LM flag
    # spellings older Megatron-LM releases had (since removed there)
    "--moe-token-dropping", "--moe-use-legacy-grouped-gemm",
)


class NegationAction(argparse._StoreConstAction):
    """`--no-X` for an on/off flag `--X` (or `--X` for `--no-X`): sets its value back."""


def mark_extensions(parser: argparse.ArgumentParser) -> None:
    """Start the help of every MEGAMOE_EXTENSIONS flag with "megamoe extension"."""
    for action in parser._actions:
        if any(s in MEGAMOE_EXTENSIONS for s in action.option_strings):
            text = action.help or ""
            if not text.startswith(MARK):
                action.help = f"{MARK}: {text}" if text else MARK


def counterpart(flag: str) -> str:
    """--X -> --no-X, --no-X -> --X."""
    return "--" + flag[5:] if flag.startswith("--no-") else "--no-" + flag[2:]


def add_negations(parser: argparse.ArgumentParser, skip: tuple[str, ...]) -> None:
    """For each on/off flag (store_true / store_false) not in `skip`, its counterpart,
    unless the parser already has a flag of that name. The counterpart's default is
    SUPPRESS, so the original flag's default stays the value when neither is given."""
    taken = {s for a in parser._actions for s in a.option_strings}
    for action in list(parser._actions):
        if not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            continue
        flag = action.option_strings[0]
        other = counterpart(flag)
        if flag in skip or other in taken:
            continue
        parser.add_argument(other, dest=action.dest, action=NegationAction,
                            const=not action.const, default=argparse.SUPPRESS,
                            help=f"{MARK}: undo {flag} (as given by a --config preset)")
        taken.add(other)
