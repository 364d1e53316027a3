"""Checkpoint and logging flags of Megatron-LM that its own MoE configs and example
scripts pass often (the W&B run, the timers, torch_dist saving), with Megatron's names,
defaults and meanings. What megamoe does for each: docs/megatron-checkpoints.md and the
config fields (config/train.py) they set.

Megatron's deprecated --ckpt-fully-parallel-save is accepted as Megatron accepts it: it has
no effect (fully parallel saving is the default; --no-ckpt-fully-parallel-save turns it
off).
"""

from __future__ import annotations

import argparse

# Accepted on/off flags that megamoe's torch_dist checkpointing always behaves as (no
# negation: nothing to undo); docs/megatron-checkpoints.md says why for each.
CKPT_NO_OPS = ("--ckpt-fully-parallel-save", "--dist-ckpt-optim-fully-reshardable",
               "--use-persistent-ckpt-worker", "--override-opt-param-scheduler",
               "--override-opt_param-scheduler", "--ckpt-fully-parallel-load")


def add_ckpt_log_args(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("torch_dist checkpointing (Megatron-LM's)")
    c.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save",
                   action="store_false",
                   help="torch_dist: each tensor that data-parallel replicas share is written "
                        "by the lowest rank holding it, not spread over the replicas")
    c.add_argument("--ckpt-fully-parallel-save", action="store_true",
                   dest="ckpt_fully_parallel_save_deprecated",
                   help="deprecated (Megatron-LM): no effect; fully parallel saving is the "
                        "default")
    c.add_argument("--ckpt-assume-constant-structure", action="store_true",
                   help="torch_dist: plan the first save and reuse its plan for the later "
                        "ones (the state's structure must not change during the run)")
    c.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="accepted: every rank reads its own shards from storage (DCP), the "
                        "run prints one line saying so")
    c.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="accepted (a no-op): optimizer states are always saved per parameter, "
                        "loadable under any TP/PP/EP/DP layout")
    c.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="accepted (a no-op): --async-save writes on a thread of the training "
                        "process; there is no worker process to keep")
    c.add_argument("--save-retain-interval", type=int, default=None,
                   help="each save deletes the checkpoint before it unless its iteration is "
                        "a multiple of this (a multiple of --save-interval)")
    for flag in ("--override-opt-param-scheduler", "--override-opt_param-scheduler"):
        c.add_argument(flag, action="store_true", dest="override_opt_param_scheduler",
                       help="accepted (a no-op): the learning-rate schedule always comes from "
                            "the command line; a checkpoint gives only its step count")

    lg = parser.add_argument_group("logging (Megatron-LM's)")
    lg.add_argument("--wandb-project", default=None)
    lg.add_argument("--wandb-exp-name", default=None)
    lg.add_argument("--wandb-save-dir", default=None)
    lg.add_argument("--wandb-entity", default=None,
                    help="the W&B entity (team or user) the run is logged under")
    lg.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                    help="Megatron's timers: 0 iteration time; 1 also forward-backward, "
                         "optimizer and their parts; 2 is not supported yet")
    lg.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                    help="the timers over ranks: the maximum, min and max, or every rank's")
