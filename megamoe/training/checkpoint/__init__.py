"""Checkpoints: two formats (single file, sharded torch_dist) behind one protocol of
directories and publishing (publish.py), loaded without running code (safe_load.py), and
one manager that training talks to (manager.py)."""

from megamoe.training.checkpoint.dist import (
    AsyncDistSaver,
    build_single_process_model,
    load_dist_checkpoint,
    read_common,
    read_dist_tensors,
    save_dist_checkpoint,
)
from megamoe.training.checkpoint.publish import (
    COMMON,
    FILENAME,
    PAUSE_ENV,
    TRACKER,
    checkpoint_file,
    is_dist_checkpoint,
    iteration_dir,
    list_checkpoints,
    prune_checkpoints,
    read_tracker,
)
from megamoe.training.checkpoint.reader import read_checkpoint
from megamoe.training.checkpoint.safe_load import CheckpointError
from megamoe.training.checkpoint.single_file import (
    AsyncCheckpointWriter,
    build_state,
    load_checkpoint,
    save_checkpoint,
    write_checkpoint,
)

__all__ = [
    "COMMON", "FILENAME", "PAUSE_ENV", "TRACKER", "AsyncCheckpointWriter", "AsyncDistSaver",
    "CheckpointError", "build_single_process_model", "build_state", "checkpoint_file",
    "is_dist_checkpoint", "iteration_dir", "list_checkpoints", "load_checkpoint",
    "load_dist_checkpoint", "prune_checkpoints", "read_checkpoint", "read_common",
    "read_dist_tensors", "read_tracker", "save_checkpoint", "save_dist_checkpoint",
    "write_checkpoint",
]
