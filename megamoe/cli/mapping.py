"""Parsed Megatron-style flags -> the per-feature configs.

No flag is mapped by hand: each config field declares the flag that sets it
(megamoe/config/fields.py), and `config_from_args` reads exactly those. The few values no
flag sets directly (the tokenizer's vocabulary, the MoE layer pattern, the world size)
are passed in explicitly. Building the configs runs their validation.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from megamoe.config import (
    CheckpointConfig,
    DataConfig,
    Fp8Config,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    MoEExecutionConfig,
    MoETrainingConfig,
    OptimizerConfig,
    ParallelConfig,
    RecomputeConfig,
    RunConfig,
    TrainConfig,
)
from megamoe.config.batch_schedule import parse_step_schedule

C = TypeVar("C")


def config_from_args(cls: type[C], args: argparse.Namespace, **derived: Any) -> C:
    """`cls` with every flag-declared field read from `args`, plus `derived` values."""
    values = {f.name: getattr(args, f.metadata["dest"]) for f in dataclasses.fields(cls)
              if "dest" in f.metadata and hasattr(args, f.metadata["dest"])}
    return cls(**values, **derived)


def jsonable(args: argparse.Namespace) -> dict:
    """The flags as plain values (kept with checkpoints, sent to W&B)."""
    return {k: v for k, v in vars(args).items()
            if isinstance(v, (int, float, str, bool, list, type(None)))}


def _step_schedule(args: argparse.Namespace):
    """--step-batch-size-schedule in samples: pretrain_gpt.py's thresholds count tokens."""
    text = getattr(args, "step_batch_size_schedule", None)
    return None if text is None else parse_step_schedule(text, args.seq_length)


def run_config_from_args(args: argparse.Namespace, vocab_size: int) -> RunConfig:
    """Validated namespace (+ the tokenizer's vocabulary size) -> RunConfig."""
    moe = config_from_args(MoEConfig, args) if args.num_experts is not None else None
    model = config_from_args(ModelConfig, args, vocab_size=vocab_size, moe=moe,
                             moe_layer_pattern=args.moe_layer_pattern if moe else None,
                             # TP < 1 is named by ParallelConfig's own check
                             vocab_padding_tp=max(1, args.tensor_model_parallel_size))
    return RunConfig(
        model=model,
        parallel=config_from_args(ParallelConfig, args, world_size=args.world_size),
        data=config_from_args(DataConfig, args),
        optim=config_from_args(OptimizerConfig, args),
        train=config_from_args(TrainConfig, args, batch_size_schedule=_step_schedule(args)),
        checkpoint=config_from_args(CheckpointConfig, args),
        logging=config_from_args(LoggingConfig, args),
        moe_execution=config_from_args(MoEExecutionConfig, args),
        moe_training=config_from_args(MoETrainingConfig, args),
        recompute=config_from_args(RecomputeConfig, args),
        fp8=config_from_args(Fp8Config, args),
        command_line=jsonable(args))
