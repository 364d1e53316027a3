"""What every direction of convert.py shares: its error, the flags -> validated namespace
step, and the shape check of a converted state dict against the model it must fill."""

from __future__ import annotations

import argparse
import contextlib
import io

import torch

from megamoe.cli.arguments import build_parser
from megamoe.cli.rules import finalize_args
from megamoe.config import ModelConfig
from megamoe.config.fields import ConfigError
from megamoe.model.gpt_model import GPTModel
from megamoe.training.checkpoint.reader import read_checkpoint
from megamoe.training.checkpoint.safe_load import CheckpointError


class ConvertError(Exception):
    """Unusable input or output; the message names the file or flag."""


def build_args(flags: list[str], where: str) -> argparse.Namespace:
    """Flags -> a validated namespace, as pretrain_gpt.py would see them for a run that
    does not train (--skip-train, which the saved flags drop: a top-1 Mixtral's router,
    weight 1.0 per token, is refused for training, as by Megatron, but converts and
    evaluates exactly)."""
    parser = build_parser()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # argparse's usage + error: one line here
            args = parser.parse_args(flags + ["--dry-run", "--skip-train"])
    except SystemExit:
        last = (said.getvalue().strip().splitlines() or [""])[-1]
        why = last.split("error: ", 1)[1] if "error: " in last else "do not parse"
        raise ConvertError(f"{where}: the saved arguments are not valid pretrain_gpt.py "
                           f"flags ({why})") from None
    try:
        finalize_args(args, parser, world_size=1)
    except ConfigError as e:  # (ArgumentError is one)
        raise ConvertError(f"{where}: {e}") from None
    args.dry_run = False
    return args


def check_shapes(sd: dict[str, torch.Tensor], config: ModelConfig, where: str) -> None:
    with torch.device("meta"):
        want = GPTModel(config).state_dict()
    for key, ref in want.items():
        if key not in sd:
            raise ConvertError(f"{where}: no weight for {key}")
        if tuple(sd[key].shape) != tuple(ref.shape):
            raise ConvertError(f"{where}: {key} has shape {tuple(sd[key].shape)}, the config "
                               f"implies {tuple(ref.shape)}")
    extra = sorted(set(sd) - set(want))
    if extra:
        raise ConvertError(f"{where}: unexpected weights {extra[:4]}")


def read_megamoe_checkpoint(ckpt: str) -> tuple[dict, ModelConfig]:
    """A megamoe checkpoint's state and model config, for the export directions (a
    checkpoint without a stored config predates them: load and save it again)."""
    try:
        state = read_checkpoint(ckpt)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    if not state.get("model_config"):
        raise ConvertError(f"{state['_file']}: holds no model config (saved by an older "
                           f"megamoe); load it with pretrain_gpt.py and save it again")
    return state, ModelConfig.from_dict(state["model_config"])

