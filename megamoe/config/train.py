"""The training run: batches and iterations, checkpointing, logging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.config.fields import check_positive, check_range, flag, require

CKPT_FORMATS = ("torch", "torch_dist")


@dataclass
class TrainConfig:
    micro_batch_size: int = flag("--micro-batch-size", 1)
    global_batch_size: int = flag("--global-batch-size", 1)
    train_iters: int = flag("--train-iters", 10)
    seed: int = flag("--seed", 1234)
    eval_interval: int = flag("--eval-interval", 1000)
    eval_iters: int = flag("--eval-iters", 10)
    skip_train: bool = flag("--skip-train", False)
    exit_interval: Optional[int] = flag("--exit-interval", None)
    exit_duration_in_mins: Optional[float] = flag("--exit-duration-in-mins", None)
    exit_signal_handler: bool = flag("--exit-signal-handler", False)
    # Megatron's default: a NaN/Inf in a rank's loss or gradients stops the run before the
    # optimizer step (training/nonfinite.py); off, such steps are skipped.
    check_for_nan_in_loss_and_grad: bool = flag("--no-check-for-nan-in-loss-and-grad", True,
                                                dest="check_for_nan_in_loss_and_grad")
    # Megatron's torch.cuda.empty_cache() calls: >= 1 after each forward-backward (training
    # and evaluation), >= 2 also after the optimizer step (training/loop.py).
    empty_unused_memory_level: int = flag("--empty-unused-memory-level", 0)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_positive(self, "micro_batch_size", "global_batch_size", "eval_interval",
                       "exit_interval", "exit_duration_in_mins")
        check_positive(self, "train_iters", "eval_iters", allow_zero=True)
        check_range(self, "seed", 0, 2**32, high_open=True)  # numpy's seed range
        require(self.empty_unused_memory_level in (0, 1, 2),
                f"--empty-unused-memory-level must be 0, 1 or 2, "
                f"got {self.empty_unused_memory_level}")


@dataclass
class CheckpointConfig:
    save: Optional[str] = flag("--save", None)
    load: Optional[str] = flag("--load", None)
    save_interval: Optional[int] = flag("--save-interval", None)
    no_load_optim: bool = flag("--no-load-optim", False)
    no_load_rng: bool = flag("--no-load-rng", False)
    no_save_optim: bool = flag("--no-save-optim", False)
    no_save_rng: bool = flag("--no-save-rng", False)
    finetune: bool = flag("--finetune", False)
    async_save: bool = flag("--async-save", False)
    ckpt_keep_last: Optional[int] = flag("--ckpt-keep-last", None)  # None = keep all
    ckpt_format: str = flag("--ckpt-format", "torch_dist")  # loading detects the format

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_positive(self, "save_interval", "ckpt_keep_last")
        require(self.ckpt_format in CKPT_FORMATS,
                f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}, "
                f"got {self.ckpt_format!r}")
        for name, value in (("--save-interval", self.save_interval),
                            ("--ckpt-keep-last", self.ckpt_keep_last),
                            ("--async-save", self.async_save or None)):
            require(value is None or self.save is not None, f"{name} needs --save")


@dataclass
class LoggingConfig:
    log_interval: int = flag("--log-interval", 100)
    tensorboard_dir: Optional[str] = flag("--tensorboard-dir", None)
    tensorboard_log_interval: int = flag("--tensorboard-log-interval", 1)
    wandb_project: Optional[str] = flag("--wandb-project", None)
    wandb_exp_name: Optional[str] = flag("--wandb-exp-name", None)
    wandb_save_dir: Optional[str] = flag("--wandb-save-dir", None)
    log_throughput: bool = flag("--log-throughput", False)
    peak_tflops: Optional[float] = flag("--peak-tflops", None)  # per device; None: GPU table
    timing_log_level: int = flag("--timing-log-level", 0)
    # Megatron's "params norm: X" / "num zeros: N" in the log line (and TensorBoard), each
    # computed only when asked for: every parameter / gradient element counted once.
    log_params_norm: bool = flag("--log-params-norm", False)
    log_num_zeros_in_grad: bool = flag("--log-num-zeros-in-grad", False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_positive(self, "log_interval", "tensorboard_log_interval", "peak_tflops")
        # Megatron's timers (levels 1 and 2) are not built: only 0 means what it says.
        require(self.timing_log_level == 0, "not supported yet: --timing-log-level > 0")
