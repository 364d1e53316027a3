"""TensorBoard and W&B targets checked before training starts.

A missing package or an unwritable directory surfaced late, on the one rank that logs,
after the process groups exist: its traceback ends that rank while the others wait in a
collective, and W&B prints thousands of lines on a full disk. Every rank checks the same
things up front instead (the directories are shared by the ranks that write them), so a
bad target is one line and exit 1 before anything else runs.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

from megamoe.config.train import LoggingConfig


def wandb_dir(wandb_save_dir: str | None, tensorboard_dir: str | None) -> str:
    """Where W&B writes: --wandb-save-dir, else <--tensorboard-dir or .>/wandb."""
    return wandb_save_dir or os.path.join(tensorboard_dir or ".", "wandb")


class LogTargetError(OSError):
    """A logging target that cannot be used; names the flag and the directory."""


def _writable(flag: str, path: str) -> None:
    """Create `path` and write and sync a small file in it: on a full disk, a read-only
    mount or a path through a regular file this raises here, not mid-run."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".megamoe-probe-") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise LogTargetError(f"{flag}: cannot write to {path} ({e.strerror or e})") from None


def _importable(flag: str, module: str, extra: str) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise LogTargetError(f"{flag} needs the {module} package: pip install -e .[{extra}]")


def check_log_targets(logging: LoggingConfig) -> None:
    """Raise LogTargetError for a logging flag this machine cannot honour."""
    if logging.tensorboard_dir:
        _importable("--tensorboard-dir", "tensorboard", "logging")
        _writable("--tensorboard-dir", logging.tensorboard_dir)
    if logging.wandb_project:
        _importable("--wandb-project", "wandb", "logging")
        _writable("--wandb-save-dir" if logging.wandb_save_dir else "--wandb-project",
                  wandb_dir(logging.wandb_save_dir, logging.tensorboard_dir))
