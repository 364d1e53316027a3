"""The optimizer and its learning-rate schedule (Megatron's OptimizerParamScheduler)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.config.fields import check_positive, check_range, flag, require

OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


WD_INCR_STYLES = ("constant", "linear", "cosine")
FP32_MAX = 3.4028234663852886e38  # the largest finite fp32 (a loss scale is fp32)
# Megatron's precision-aware optimizer: the choices its parser offers
MAIN_GRADS_DTYPES = ("fp32", "bf16")
MAIN_PARAMS_DTYPES = ("fp32", "fp16")
STATE_DTYPES = ("fp32", "fp16", "bf16", "fp8")


@dataclass
class OptimizerConfig:
    optimizer: str = flag("--optimizer", "adam")
    lr: float = flag("--lr", 1e-4)
    min_lr: float = flag("--min-lr", 0.0)
    weight_decay: float = flag("--weight-decay", 0.01)
    # Megatron's get_standard_config_overrides: biases and 1-D parameters have no weight
    # decay, except (with this flag) the q/k layernorms' ("q_layernorm." / "k_layernorm."
    # in the name), as Qwen3-Next.
    apply_wd_to_qk_layernorm: bool = flag("--apply-wd-to-qk-layernorm", False)
    # Megatron's decoupled LR: the word embedding and output layer weights follow the same
    # schedule with --decoupled-lr as the peak and --decoupled-min-lr (else --min-lr) as
    # the floor (their param group's max_lr / min_lr).
    decoupled_lr: Optional[float] = flag("--decoupled-lr", None)
    decoupled_min_lr: Optional[float] = flag("--decoupled-min-lr", None)
    # Megatron's weight-decay schedule (training/schedules/lr.py): constant --weight-decay,
    # or from --start-weight-decay to --end-weight-decay over the whole run.
    weight_decay_incr_style: str = flag("--weight-decay-incr-style", "constant")
    start_weight_decay: Optional[float] = flag("--start-weight-decay", None)
    end_weight_decay: Optional[float] = flag("--end-weight-decay", None)
    adam_beta1: float = flag("--adam-beta1", 0.9)
    adam_beta2: float = flag("--adam-beta2", 0.999)
    adam_eps: float = flag("--adam-eps", 1e-8)
    sgd_momentum: float = flag("--sgd-momentum", 0.9)
    clip_grad: float = flag("--clip-grad", 1.0)
    bf16: bool = flag("--bf16", False)
    fp16: bool = flag("--fp16", False)
    # Loss scaling (Megatron's grad_scaler.py; training/optim/grad_scaler.py): a constant
    # --loss-scale, else with --fp16 the dynamic scaler's start, floor, growth window and
    # hysteresis. Megatron's defaults; --loss-scale 0 means unset, as Megatron's `if`.
    loss_scale: Optional[float] = flag("--loss-scale", None)
    initial_loss_scale: float = flag("--initial-loss-scale", 2.0**32)
    min_loss_scale: float = flag("--min-loss-scale", 1.0)
    loss_scale_window: float = flag("--loss-scale-window", 1000.0)
    hysteresis: int = flag("--hysteresis", 2)
    # Megatron's --use-precision-aware-optimizer (Transformer Engine's FusedAdam): Adam's
    # moments stored in --exp-avg-dtype / --exp-avg-sq-dtype, main gradients accumulated and
    # reduced in --main-grads-dtype; the update runs in fp32 (training/optim/state_precision.py).
    use_precision_aware_optimizer: bool = flag("--use-precision-aware-optimizer", False)
    main_grads_dtype: str = flag("--main-grads-dtype", "fp32")
    exp_avg_dtype: str = flag("--exp-avg-dtype", "fp32")
    exp_avg_sq_dtype: str = flag("--exp-avg-sq-dtype", "fp32")
    # LR schedule: the *-iters flags with --train-iters, the *-samples flags with
    # --train-samples (RunConfig checks the pairing, as Megatron's validate_args).
    lr_warmup_iters: int = flag("--lr-warmup-iters", 0)
    lr_warmup_samples: int = flag("--lr-warmup-samples", 0)
    lr_warmup_fraction: Optional[float] = flag("--lr-warmup-fraction", None)
    lr_warmup_init: float = flag("--lr-warmup-init", 0.0)
    lr_decay_iters: Optional[int] = flag("--lr-decay-iters", None)
    lr_decay_samples: Optional[int] = flag("--lr-decay-samples", None)
    lr_decay_style: str = flag("--lr-decay-style", "linear")
    lr_wsd_decay_iters: Optional[int] = flag("--lr-wsd-decay-iters", None)
    lr_wsd_decay_samples: Optional[int] = flag("--lr-wsd-decay-samples", None)
    lr_wsd_decay_style: str = flag("--lr-wsd-decay-style", "exponential")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for value, allowed, name in ((self.optimizer, OPTIMIZERS, "--optimizer"),
                                     (self.lr_decay_style, LR_DECAY_STYLES, "--lr-decay-style"),
                                     (self.lr_wsd_decay_style, WSD_DECAY_STYLES,
                                      "--lr-wsd-decay-style")):
            require(value in allowed,
                    f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        require(not (self.fp16 and self.bf16), "--fp16 and --bf16 are mutually exclusive")
        self._validate_loss_scaling()
        self._validate_weight_decay_schedule()
        self._validate_precision_aware()
        check_positive(self, "lr_decay_samples")
        check_positive(self, "lr_warmup_samples", "lr_wsd_decay_samples", allow_zero=True)
        self._validate_ranges()

    @property
    def dynamic_loss_scaling(self) -> bool:
        """--fp16 without a --loss-scale: Megatron's DynamicGradScaler."""
        return self.fp16 and not self.loss_scale

    def _validate_loss_scaling(self) -> None:
        """Megatron's scaler assertions (grad_scaler.py), as one line naming the flag. The
        window is compared with an integer step counter there, so a fractional one would
        never grow the scale: refused. The scales are fp32 there: one past fp32's range
        would be Inf, and an Inf scale never backs off (Inf x 0.5): refused too."""
        check_range(self, "loss_scale", 0, FP32_MAX, high_open=False)
        check_range(self, "initial_loss_scale", 0, FP32_MAX, low_open=True, high_open=False)
        check_range(self, "min_loss_scale", 0, FP32_MAX, low_open=True, high_open=False)
        check_range(self, "loss_scale_window", 1)
        check_range(self, "hysteresis", 1)
        require(float(self.loss_scale_window).is_integer(),
                f"--loss-scale-window must be a whole number of iterations, got "
                f"{self.loss_scale_window}")
        require(not self.dynamic_loss_scaling or self.min_loss_scale <= self.initial_loss_scale,
                f"--min-loss-scale ({self.min_loss_scale}) must not exceed "
                f"--initial-loss-scale ({self.initial_loss_scale})")

    def _validate_weight_decay_schedule(self) -> None:
        """Megatron's validate_args: constant takes --weight-decay only; linear and cosine
        need both ends."""
        style = self.weight_decay_incr_style
        require(style in WD_INCR_STYLES, f"--weight-decay-incr-style must be one of "
                f"{', '.join(WD_INCR_STYLES)}, got {style!r}")
        ends = (self.start_weight_decay, self.end_weight_decay)
        if style == "constant":
            require(ends == (None, None), "--start-weight-decay and --end-weight-decay need "
                    "--weight-decay-incr-style linear or cosine")
        else:
            require(None not in ends, f"--weight-decay-incr-style {style} needs "
                    "--start-weight-decay and --end-weight-decay")
        check_range(self, "start_weight_decay", 0)
        check_range(self, "end_weight_decay", 0)

    def _validate_precision_aware(self) -> None:
        """Megatron's OptimizerConfig rules: the dtypes other than fp32 need the flag, which
        needs Adam. Refused here: fp8 moments (TE's Float8Tensor scaling is not matched)
        and --main-grads-dtype bf16 without --bf16, where Megatron has no separate main
        gradient and would ignore it. (--main-params-dtype: cli/precision_args.py.)"""
        dtypes = (("--main-grads-dtype", self.main_grads_dtype, MAIN_GRADS_DTYPES),
                  ("--exp-avg-dtype", self.exp_avg_dtype, STATE_DTYPES),
                  ("--exp-avg-sq-dtype", self.exp_avg_sq_dtype, STATE_DTYPES))
        for name, value, allowed in dtypes:
            require(value in allowed, f"{name} must be one of {', '.join(allowed)}, "
                    f"got {value!r}")
            require(value == "fp32" or self.use_precision_aware_optimizer,
                    f"{name} {value} needs --use-precision-aware-optimizer (without it "
                    "Megatron keeps every optimizer tensor in fp32)")
        if not self.use_precision_aware_optimizer:
            return
        require(self.optimizer == "adam",
                "--use-precision-aware-optimizer only supported with --optimizer adam")
        for name, value, _ in dtypes[1:]:
            require(value != "fp8", f"not supported yet: {name} fp8 (Transformer Engine's "
                    "per-tensor FP8 scaling)")
        require(self.main_grads_dtype == "fp32" or self.bf16, "--main-grads-dtype bf16 "
                "needs --bf16 (an fp32 model's gradients are its main gradients)")

    def _validate_ranges(self) -> None:
        """Each value within what it means (torch.optim's and Megatron's
        OptimizerParamScheduler's assertions, as one line naming the flag)."""
        for name in ("lr", "min_lr", "lr_warmup_init", "weight_decay", "sgd_momentum",
                     "clip_grad"):
            check_range(self, name, 0)
        check_range(self, "adam_beta1", 0, 1)
        check_range(self, "adam_beta2", 0, 1)
        check_range(self, "adam_eps", 0, low_open=True)
        check_range(self, "lr_warmup_fraction", 0, 1)  # (1: no step would decay)
        check_positive(self, "lr_warmup_iters", allow_zero=True)
        check_positive(self, "lr_decay_iters", "lr_wsd_decay_iters")
        require(self.min_lr <= self.lr,
                f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        check_range(self, "decoupled_lr", 0)
        check_range(self, "decoupled_min_lr", 0)
        require(self.decoupled_min_lr is None or self.decoupled_lr is not None,
                "--decoupled-min-lr needs --decoupled-lr")
        require(self.decoupled_min_lr is None or self.decoupled_min_lr <= self.decoupled_lr,
                f"--decoupled-min-lr ({self.decoupled_min_lr}) must not exceed "
                f"--decoupled-lr ({self.decoupled_lr})")
        require(self.lr_warmup_init <= self.lr,
                f"--lr-warmup-init ({self.lr_warmup_init}) must not exceed --lr ({self.lr})")
