"""The training run: batches and iterations (or samples), checkpointing, logging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.config import batch_schedule as bsched
from megamoe.config.fields import check_positive, check_range, derived, flag, require

CKPT_FORMATS = ("torch", "torch_dist")
DEFAULT_TRAIN_ITERS = 10  # a library user's TrainConfig() (the command line needs a length)


@dataclass
class TrainConfig:
    micro_batch_size: int = flag("--micro-batch-size", 1)
    global_batch_size: int = flag("--global-batch-size", 1)
    # [start batch size, increment, ramp-up samples]: the old Megatron batch-size ramp-up
    # (sample-based training only; Megatron now ignores it), run as the step schedule it
    # translates to (config/batch_schedule.py); global_batch_size is the size after it.
    rampup_batch_size: Optional[list[int]] = flag("--rampup-batch-size", None)
    # Megatron's step schedule "THRESHOLD:BATCH ..." (thresholds in tokens on the command
    # line); global_batch_size is its last size.
    step_batch_size_schedule: Optional[str] = flag("--step-batch-size-schedule", None)
    # [[threshold in samples, global batch size], ...] of either flag; None: constant.
    batch_size_schedule: Optional[list[list[int]]] = derived(
        "--step-batch-size-schedule (tokens / --seq-length) or --rampup-batch-size", None)
    # Iteration- or sample-based training, as in Megatron: give one. With --train-samples,
    # train_iters becomes the number of iterations that consume them (Megatron's
    # update_train_iters); it is None only before __post_init__ derives it.
    train_iters: Optional[int] = flag("--train-iters", None)
    train_samples: Optional[int] = flag("--train-samples", None)
    seed: int = flag("--seed", 1234)
    # Megatron's default None: no evaluation during training, only the validation and test
    # evaluations after it (when --eval-iters > 0).
    eval_interval: Optional[int] = flag("--eval-interval", None)
    eval_iters: int = flag("--eval-iters", 10)
    skip_train: bool = flag("--skip-train", False)
    exit_interval: Optional[int] = flag("--exit-interval", None)
    exit_duration_in_mins: Optional[float] = flag("--exit-duration-in-mins", None)
    exit_signal_handler: bool = flag("--exit-signal-handler", False)
    # Megatron's default: a NaN/Inf in a rank's loss or gradients stops the run before the
    # optimizer step (training/nonfinite.py); off, such steps are skipped.
    check_for_nan_in_loss_and_grad: bool = flag("--no-check-for-nan-in-loss-and-grad", True,
                                                dest="check_for_nan_in_loss_and_grad")
    # Megatron's run-health checks (cli/runhealth_args.py): the parameters' hashes compared
    # over the data-parallel replicas every N iterations (training/weight_hash.py), and a
    # warning for a local micro-batch loss >= 10x the largest of the first 100
    # (training/spiky_loss.py).
    check_weight_hash_across_dp_replicas_interval: Optional[int] = flag(
        "--check-weight-hash-across-dp-replicas-interval", None)
    check_for_spiky_loss: bool = flag("--check-for-spiky-loss", False)
    # Megatron's torch.cuda.empty_cache() calls: >= 1 after each forward-backward (training
    # and evaluation), >= 2 also after the optimizer step (training/loop.py).
    empty_unused_memory_level: int = flag("--empty-unused-memory-level", 0)
    # Megatron's --calculate-per-token-loss: the step's LM loss is the sum over every
    # unmasked token of the global batch / their number (not the mean of per-micro-batch
    # means); training/loss.py.
    calculate_per_token_loss: bool = flag("--calculate-per-token-loss", False)
    # megamoe's extension (not a Megatron flag): torch.compile each transformer layer.
    compile: bool = flag("--compile", False)
    # Megatron's --manual-gc: the automatic collector off, collections at fixed points
    # (training/manual_gc.py).
    manual_gc: bool = flag("--manual-gc", False)
    manual_gc_interval: int = flag("--manual-gc-interval", 0)
    manual_gc_eval: bool = flag("--no-manual-gc-eval", True, dest="manual_gc_eval")

    def __post_init__(self) -> None:
        if self.rampup_batch_size is not None:
            self.rampup_batch_size = [int(v) for v in self.rampup_batch_size]
        if self.batch_size_schedule is None and self.step_batch_size_schedule is not None:
            # a library user's schedule: thresholds in samples (no --seq-length here)
            self.batch_size_schedule = bsched.parse_step_schedule(
                self.step_batch_size_schedule, None)
        if self.batch_size_schedule is not None:
            self.global_batch_size = self.batch_size_schedule[-1][1]
        self.validate()

    def validate(self) -> None:
        check_positive(self, "micro_batch_size", "global_batch_size", "eval_interval",
                       "exit_interval", "train_samples", "exit_duration_in_mins",
                       "check_weight_hash_across_dp_replicas_interval")
        check_positive(self, "eval_iters", "manual_gc_interval", allow_zero=True)
        check_range(self, "seed", 0, 2**32, high_open=True)  # numpy's seed range
        require(self.empty_unused_memory_level in (0, 1, 2),
                f"--empty-unused-memory-level must be 0, 1 or 2, "
                f"got {self.empty_unused_memory_level}")
        require(self.rampup_batch_size is None or self.step_batch_size_schedule is None,
                "cannot specify both --step-batch-size-schedule and --rampup-batch-size")
        self._check_rampup()
        if self.rampup_batch_size is not None and self.batch_size_schedule is None:
            start, increment, samples = self.rampup_batch_size
            self.batch_size_schedule = bsched.rampup_as_step_schedule(
                start, increment, samples, self.global_batch_size)
        if self.train_iters is None:
            self.train_iters = (self._iters_for_samples() if self.train_samples is not None
                                else DEFAULT_TRAIN_ITERS)
        check_positive(self, "train_iters", allow_zero=True)
        # with --train-samples, train_iters is derived (and equal to it when validated again)
        require(self.train_samples is None or self.train_iters == self._iters_for_samples(),
                "--train-iters and --train-samples are mutually exclusive")

    def _check_rampup(self) -> None:
        """Megatron's RampupBatchsizeNumMicroBatchesCalculator rules (it divides by the
        number of increments and by the ramp-up samples, so neither may be 0)."""
        r = self.rampup_batch_size
        if r is None:
            return
        require(self.train_samples is not None,
                "--rampup-batch-size needs --train-samples (no batch-size ramp-up in "
                "iteration-based training)")
        require(len(r) == 3, "--rampup-batch-size takes <start batch size> "
                             "<batch size increment> <ramp-up samples>")
        start, increment, samples = r
        for name, value in (("start batch size", start), ("batch size increment", increment),
                            ("ramp-up samples", samples)):
            require(value > 0, f"--rampup-batch-size: {name} must be positive, got {value}")
        diff = self.global_batch_size - start
        require(diff > 0, f"--rampup-batch-size: start batch size ({start}) must be smaller "
                          f"than --global-batch-size ({self.global_batch_size})")
        require(diff % increment == 0,
                f"--rampup-batch-size: --global-batch-size ({self.global_batch_size}) minus "
                f"the start batch size ({start}) must be divisible by the batch size "
                f"increment ({increment})")

    def evaluations_by(self, iteration: int) -> int:
        """Validation runs during training up to `iteration` (one per --eval-interval)."""
        return iteration // self.eval_interval if self.eval_interval else 0

    def ramp_batch_sizes(self) -> list[int]:
        """Every global batch size of the schedule, the final one last."""
        if self.batch_size_schedule is None:
            return [self.global_batch_size]
        return [bs for _, bs in self.batch_size_schedule]

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of the step that starts after `consumed_samples`
        (Megatron's StepBatchsizeNumMicroBatchesCalculator.update)."""
        if self.batch_size_schedule is None:
            return self.global_batch_size
        return bsched.batch_size_at(self.batch_size_schedule, consumed_samples)

    def _iters_for_samples(self) -> int:
        """Megatron's update_train_iters: whole global batches of --train-samples (a
        partial last batch dropped), or with a schedule the steps until the consumed
        samples reach --train-samples (the last step may pass it)."""
        if self.batch_size_schedule is None:
            return self.train_samples // self.global_batch_size
        return bsched.iterations_for_samples(self.batch_size_schedule, self.train_samples)

    def samples_for_iters(self, iterations: int) -> int:
        """Samples consumed by the first `iterations` steps (schedule included)."""
        if self.batch_size_schedule is None:
            return iterations * self.global_batch_size
        return bsched.samples_for_iterations(self.batch_size_schedule, iterations)


STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
              "raise_all", "return_unexpected", "return_all", "ignore_all")


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
    ckpt_step: Optional[int] = flag("--ckpt-step", None)  # load iter_N of --load
    exit_on_missing_checkpoint: bool = flag("--exit-on-missing-checkpoint", False)
    # Megatron's: a torch_dist checkpoint loads under --ckpt-format torch only with it
    # (torch_dist always detects the format, as Megatron's loader).
    auto_detect_ckpt_format: bool = flag("--auto-detect-ckpt-format", False)
    # Megatron's StrictHandling for torch_dist loads (training/checkpoint/strictness.py).
    dist_ckpt_strictness: str = flag("--dist-ckpt-strictness", "assume_ok_unexpected")
    # torch_dist saves (training/checkpoint/save_planner.py): a tensor replicas share is
    # written by one of them, spread over the replicas (Megatron's fully parallel save) or,
    # with --no-ckpt-fully-parallel-save, the lowest rank; the first save's plan reused.
    ckpt_fully_parallel_save: bool = flag("--no-ckpt-fully-parallel-save", True,
                                          dest="ckpt_fully_parallel_save")
    ckpt_assume_constant_structure: bool = flag("--ckpt-assume-constant-structure", False)
    # Megatron's: a save deletes the checkpoint before it unless its iteration is a
    # multiple of this (training/checkpoint/publish.py); None keeps them (as Megatron).
    save_retain_interval: Optional[int] = flag("--save-retain-interval", None)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_positive(self, "save_interval", "ckpt_keep_last", "ckpt_step",
                       "save_retain_interval")
        require(self.save_retain_interval is None or (
            self.save_interval is not None and self.save_retain_interval % self.save_interval
            == 0), f"--save-retain-interval ({self.save_retain_interval}) must be a multiple "
            f"of --save-interval ({self.save_interval})")
        require(self.ckpt_step is None or self.load is not None, "--ckpt-step needs --load")
        require(self.dist_ckpt_strictness in STRICTNESS, f"--dist-ckpt-strictness must be one "
                f"of {', '.join(STRICTNESS)}, got {self.dist_ckpt_strictness!r}")
        require(self.ckpt_format in CKPT_FORMATS,
                f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}, "
                f"got {self.ckpt_format!r}")
        for name, given in (("--no-ckpt-fully-parallel-save", not self.ckpt_fully_parallel_save),
                            ("--ckpt-assume-constant-structure",
                             self.ckpt_assume_constant_structure)):
            require(not given or self.ckpt_format == "torch_dist",
                    f"{name} sets how torch_dist checkpoints are saved: it needs "
                    f"--ckpt-format torch_dist, got {self.ckpt_format}")
        for name, value in (("--save-interval", self.save_interval),
                            ("--ckpt-keep-last", self.ckpt_keep_last),
                            ("--save-retain-interval", self.save_retain_interval),
                            ("--async-save", self.async_save or None)):
            require(value is None or self.save is not None, f"{name} needs --save")


TIMING_LOG_OPTIONS = ("max", "minmax", "all")


@dataclass
class LoggingConfig:
    log_interval: int = flag("--log-interval", 100)
    tensorboard_dir: Optional[str] = flag("--tensorboard-dir", None)
    tensorboard_log_interval: int = flag("--tensorboard-log-interval", 1)
    wandb_project: Optional[str] = flag("--wandb-project", None)
    wandb_exp_name: Optional[str] = flag("--wandb-exp-name", None)
    wandb_save_dir: Optional[str] = flag("--wandb-save-dir", None)
    wandb_entity: Optional[str] = flag("--wandb-entity", None)
    log_throughput: bool = flag("--log-throughput", False)
    peak_tflops: Optional[float] = flag("--peak-tflops", None)  # per device; None: GPU table
    # Megatron's timers (training/timers.py): 0 iteration time; 1 also forward-backward
    # and optimizer; --log-timers-to-tensorboard writes them to TensorBoard/W&B.
    timing_log_level: int = flag("--timing-log-level", 0)
    log_timers_to_tensorboard: bool = flag("--log-timers-to-tensorboard", False)
    timing_log_option: str = flag("--timing-log-option", "minmax")  # max / minmax / all
    # Megatron's profiling range (training/profiling.py).
    profile: bool = flag("--profile", False)
    use_pytorch_profiler: bool = flag("--use-pytorch-profiler", False)
    profile_step_start: int = flag("--profile-step-start", 10)
    profile_step_end: int = flag("--profile-step-end", 12)
    profile_ranks: list[int] = flag("--profile-ranks", default_factory=lambda: [0])
    # Megatron's CUDA allocator history (training/memory_history.py).
    record_memory_history: bool = flag("--record-memory-history", False)
    memory_snapshot_path: str = flag("--memory-snapshot-path", "snapshot.pickle")
    # Megatron's "params norm: X" / "num zeros: N" in the log line (and TensorBoard), each
    # computed only when asked for: every parameter / gradient element counted once.
    log_params_norm: bool = flag("--log-params-norm", False)
    log_num_zeros_in_grad: bool = flag("--log-num-zeros-in-grad", False)
    # megamoe's console (training/console.py): the first N steps of a run get a line of
    # their own without waiting for --log-interval; 0 is Megatron's console.
    log_first_iterations: int = flag("--log-first-iterations", 3)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_positive(self, "log_interval", "tensorboard_log_interval", "peak_tflops")
        check_positive(self, "profile_step_start", "log_first_iterations", allow_zero=True)
        require(self.profile_step_end > self.profile_step_start,
                f"--profile-step-end ({self.profile_step_end}) must be greater than "
                f"--profile-step-start ({self.profile_step_start})")
        require(bool(self.memory_snapshot_path.strip()),
                "--memory-snapshot-path must name a file")
        require(all(r >= 0 for r in self.profile_ranks),
                f"--profile-ranks must be >= 0, got {self.profile_ranks}")
        require(not (self.profile and self.use_pytorch_profiler) or self.tensorboard_dir,
                "--use-pytorch-profiler writes its trace next to --tensorboard-dir: give it")
        require(self.wandb_entity is None or self.wandb_project is not None,
                "--wandb-entity needs --wandb-project (W&B logs only with a project)")
        require(self.timing_log_option in TIMING_LOG_OPTIONS, f"--timing-log-option must be "
                f"one of {', '.join(TIMING_LOG_OPTIONS)}, got {self.timing_log_option!r}")
        # Megatron's level-2 timers (per micro-batch compute and p2p) are not built.
        require(self.timing_log_level in (0, 1),
                "not supported yet: --timing-log-level 2" if self.timing_log_level == 2 else
                f"--timing-log-level must be 0, 1 or 2, got {self.timing_log_level}")
