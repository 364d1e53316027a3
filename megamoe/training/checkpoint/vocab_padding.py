"""A resumed run keeps its checkpoint's padded vocabulary.

Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP; megamoe
before this rule padded to the divisor alone, so an old TP > 1 checkpoint (or one resumed at
another TP size) can hold a different number of embedding rows than this run would pad to.
The rows past the tokenizer's vocabulary are never read (masked out of the softmax), so the
run adopts the checkpoint's row count, as Megatron does when the padded size comes from a
checkpoint, and says so in one line. A --padded-vocab-size given on the command line wins
(Megatron's `_set_arg` fills it only when unset). A checkpoint with fewer rows than this run's
vocabulary, or rows TP cannot split, still fails to load with the usual shape message.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

from megamoe.config import ModelConfig
from megamoe.training.checkpoint.config_check import saved_padded_vocab_size
from megamoe.training.checkpoint.dist import read_common
from megamoe.training.checkpoint.publish import checkpoint_file, is_dist_checkpoint


def keep_checkpoint_vocab_padding(model: ModelConfig, load: Optional[str], tp: int,
                                  log: Callable[[str], None]) -> None:
    """Before the model is built: adopt the --load checkpoint's padded vocabulary when only
    the padding differs (the checkpoint's rows hold this run's vocabulary and split evenly
    over TP; otherwise the load's shape check names the difference). Single-file checkpoints
    are TP 1 only, where the two rules agree; they are not opened here."""
    if load is None or not os.path.exists(load) or model.fixed_padded_vocab_size is not None:
        return  # (--padded-vocab-size: the run's rows are fixed; the load checks them)
    found = checkpoint_file(load)
    if found is None or not is_dist_checkpoint(found):
        return
    saved = read_common(found).get("model_config")
    if not isinstance(saved, dict):
        return  # no config: the load's own check names what differs
    rows, mine = saved_padded_vocab_size(saved), model.padded_vocab_size
    if rows is None or rows == mine or rows < model.vocab_size or rows % tp:
        return
    model.padded_vocab_size_from_checkpoint = rows
    log(f"> --load {load}: keeping the checkpoint's padded vocabulary of {rows} rows "
        f"(this run pads {model.vocab_size} to {mine}: a multiple of "
        f"--make-vocab-size-divisible-by {model.make_vocab_size_divisible_by} x "
        f"--tensor-model-parallel-size {tp}); the extra rows are never used")
