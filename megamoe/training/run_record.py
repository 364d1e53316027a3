"""The resolved configuration file a run leaves in --save (`resolved_config.yaml`, made by
cli/resolved_config.py), written once the run's setup has succeeded.

Written after the checkpoint is loaded and the data indices are built, not when the
flags are parsed: a run refused at setup (a lost pointer file, --exit-on-missing-
checkpoint, bad data) leaves --save exactly as it found it. Rank 0 writes it under a
temporary name and renames it, so a reader never sees half a file; a resumed run
replaces it with its own (the configuration it ran with).
"""

from __future__ import annotations

import os

from megamoe.training.checkpoint.safe_load import CheckpointError

FILE_NAME = "resolved_config.yaml"
# What a run leaves in --save besides checkpoints and the pointer file (the heatmap PNG
# folder: training/heatmap.py heatmap_png_dir).
RUN_RECORDS = frozenset({FILE_NAME, "expert_load"})


def save_resolved_config(text: str, save_dir: str) -> str:
    """<save_dir>/resolved_config.yaml; CheckpointError naming --save when it cannot be
    written (one line, exit 1, like any other unwritable --save)."""
    path = os.path.join(save_dir, FILE_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(save_dir, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        raise CheckpointError(f"--save: cannot write {path} ({e.strerror or e})") from None
    return path
