"""Console line, TensorBoard and Weights & Biases.

The console line follows Megatron-LM's format so existing log parsers keep working.
TensorBoard and W&B are optional: each is used only when asked for, and W&B runs offline
when no API key is configured (no network needed).
"""

from __future__ import annotations

import os
import time
from typing import Optional


def format_log_line(*, iteration: int, train_iters: int, consumed_samples: int,
                    elapsed_ms_per_iter: float, tokens_per_sec: float, learning_rate: float,
                    global_batch_size: int, losses: dict[str, float], loss_scale: float,
                    grad_norm: float, skipped_iters: int, nan_iters: int) -> str:
    parts = [
        f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms_per_iter:.1f}",
        f"throughput (tokens/s): {tokens_per_sec:.1f}",
        f"learning rate: {learning_rate:.6E}",
        f"global batch size: {global_batch_size:5d}",
        *(f"{name}: {value:.6E}" for name, value in losses.items()),
        f"loss scale: {loss_scale:.1f}",
        f"grad norm: {grad_norm:.3f}",
        f"number of skipped iterations: {skipped_iters:3d}",
        f"number of nan iterations: {nan_iters:3d}",
    ]
    return " | ".join(parts) + " |"


class MetricsLogger:
    """Scalars to TensorBoard (--tensorboard-dir) and/or W&B (--wandb-project)."""

    def __init__(self, tensorboard_dir: Optional[str], wandb_project: Optional[str],
                 wandb_exp_name: Optional[str], wandb_save_dir: Optional[str],
                 config_dict: Optional[dict] = None) -> None:
        self.tb = None
        self.wandb = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
        if wandb_project:
            import wandb

            if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
                os.environ["WANDB_MODE"] = "offline"
            save_dir = wandb_save_dir or os.path.join(tensorboard_dir or ".", "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(project=wandb_project, name=wandb_exp_name, dir=save_dir,
                                    config=config_dict or {})

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        if self.tb is not None:
            for name, value in scalars.items():
                self.tb.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
