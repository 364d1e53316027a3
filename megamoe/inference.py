"""`megamoe.from_checkpoint(path)`: a single-process model from any megamoe checkpoint
(either format, saved under any parallel layout).

The checkpoint carries its model config (written by pretrain_gpt.py and by
tools/checkpoint/convert.py), so no command line is needed:

    model = megamoe.from_checkpoint("runs/mixtral/")       # --save root, iter_N dir or file
    logits_BSV = model(input_ids_BS)                         # [B, S, vocab_size]
"""

from __future__ import annotations

from typing import Optional

import torch

from megamoe.cli.arguments import build_parser
from megamoe.cli.mapping import config_from_args, run_config_from_args
from megamoe.config import DataConfig, ModelConfig
from megamoe.data import tokenizer_for
from megamoe.model.gpt_model import GPTModel
from megamoe.training.checkpoint import (
    CheckpointError,
    build_single_process_model,
    checkpoint_file,
    is_dist_checkpoint,
    read_checkpoint,
)


def _config_from_args(saved_args: dict, file: str) -> ModelConfig:
    """Older checkpoints without a model config: rebuild it from the saved flags."""
    ns = build_parser().parse_args([])
    for k, v in saved_args.items():
        setattr(ns, k, v)
    ns.skip_train = True  # inference: the rules of a training run (top-1 routing) do not apply
    try:
        vocab_size = tokenizer_for(config_from_args(DataConfig, ns)).vocab_size
    except Exception as e:
        raise CheckpointError(f"{file}: holds no model config and its tokenizer cannot be "
                              f"loaded to find the vocabulary size ({e})") from None
    return run_config_from_args(ns, vocab_size).model


def from_checkpoint(path: str, dtype: Optional[torch.dtype] = None) -> GPTModel:
    """Rebuild the GPTModel a checkpoint was saved from, weights loaded, in eval mode.

    `path`: a --save directory (its latest checkpoint), an `iter_N` directory or the
    `model_optim_rng.pt` file. `dtype`: cast the weights (default: as saved). torch_dist
    checkpoints of any parallel layout load directly into the single-process model.
    """
    found = checkpoint_file(path)
    if found is not None and is_dist_checkpoint(found):
        model, _ = build_single_process_model(found)
        return (model if dtype is None else model.to(dtype)).eval()
    state = read_checkpoint(path)
    file = state["_file"]
    saved = state.get("model_config")
    config = ModelConfig.from_dict(saved) if saved else _config_from_args(state["args"], file)
    saved_dtype = next(iter(state["model"].values())).dtype
    model = GPTModel(config).to(saved_dtype)
    try:
        model.load_state_dict(state["model"], strict=True)
    except (RuntimeError, KeyError) as e:
        lines = str(e).strip().splitlines()
        detail = lines[1].strip() if len(lines) > 1 else lines[0]
        raise CheckpointError(f"{file}: does not match its own model config ({detail})") from None
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
