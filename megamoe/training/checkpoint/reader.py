"""Reading a checkpoint of either format whole, in one process, without a model at hand
(from_checkpoint, tools/checkpoint/convert.py)."""

from __future__ import annotations

import os

from megamoe.training.checkpoint.dist import read_dist_checkpoint
from megamoe.training.checkpoint.publish import TRACKER, checkpoint_file, is_dist_checkpoint
from megamoe.training.checkpoint.safe_load import CheckpointError
from megamoe.training.checkpoint.single_file import read_single_file


def read_checkpoint(path: str) -> dict:
    """A checkpoint's state on CPU in the single-file layout ("model" is the single-process
    state_dict, "_file" what was read); CheckpointError (naming the file) if unreadable."""
    found = checkpoint_file(path)
    if found is None:
        raise CheckpointError(f"{os.path.join(path, TRACKER)}: missing (no checkpoint in {path})")
    if is_dist_checkpoint(found):
        return read_dist_checkpoint(found)
    return read_single_file(found)
