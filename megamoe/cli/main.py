"""`pretrain_gpt.py`: Megatron-style flags -> validated configs -> a pretraining run.

Errors a user or the cluster can cause (bad flags, missing or corrupt data, unusable
checkpoints, a collective that timed out or lost a peer) end as one line on stderr and a
non-zero exit; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Optional, Sequence

from megamoe.cli.arguments import build_parser, parse_args
from megamoe.cli.determinism_args import apply_deterministic_mode
from megamoe.cli.mapping import config_from_args, run_config_from_args
from megamoe.cli.resolved_config import report_resolved_config
from megamoe.cli.rules import ArgumentError
from megamoe.config import DataConfig
from megamoe.config.fields import ConfigError
from megamoe.data import DataError, tokenizer_for
from megamoe.model.te.loader import TransformerEngineMissing, load_transformer_engine
from megamoe.model.te.support import check_run as check_te_run
from megamoe.parallel.failures import DistributedFailure
from megamoe.planning.dry_run import dry_run
from megamoe.planning.fits import check_fits
from megamoe.training import pretrain as training
from megamoe.training.checkpoint import CheckpointError
from megamoe.training.exits import UnsavedExit
from megamoe.training.log_targets import LogTargetError, check_log_targets
from megamoe.training.loop import TrainState
from megamoe.training.nonfinite import NonFiniteError
from megamoe.training.weight_hash import WeightHashMismatch

USER_ERRORS = (DataError, CheckpointError, FileNotFoundError, DistributedFailure,
               NonFiniteError, LogTargetError, WeightHashMismatch, TransformerEngineMissing)


def _dry_run_vocab_size(data: DataConfig) -> int:
    """The tokenizer's vocabulary. Under --dry-run, --vocab-size stands in for a tokenizer
    file that exists only on the cluster, so a launch script can be checked anywhere."""
    if data.vocab_size and data.tokenizer_model and not os.path.exists(data.tokenizer_model):
        return data.vocab_size
    return tokenizer_for(data).vocab_size


def set_logging_level(level: Optional[int]) -> None:
    """Megatron's --logging-level (else MEGATRON_LOGGING_LEVEL): the root logger's level."""
    env = os.environ.get("MEGATRON_LOGGING_LEVEL")
    if level is None and env is not None:
        try:
            level = int(env)
        except ValueError:
            raise ArgumentError(f"MEGATRON_LOGGING_LEVEL must be an integer, got {env!r}") \
                from None
    if level is not None:
        logging.getLogger().setLevel(level)


def pretrain(args: argparse.Namespace, print_fn: Callable[[str], None] = print) -> TrainState:
    """Run what validated flags ask for: a dry run (shapes and sizes only: no process group,
    no data) or training. The declared equivalents print what runs in their place (rank 0)."""
    if int(os.environ.get("RANK", "0")) == 0:
        for line in getattr(args, "declared_equivalents", []):
            print_fn(f"> {line}")
    data = config_from_args(DataConfig, args)
    if args.dry_run:
        dry_run(run_config_from_args(args, _dry_run_vocab_size(data)), print_fn,
                as_json=args.json)
        return TrainState()
    apply_deterministic_mode(args.deterministic_mode)
    tokenizer = tokenizer_for(data)
    run = run_config_from_args(args, tokenizer.vocab_size)
    if run.model.transformer_impl == "transformer_engine":
        check_te_run(run)  # what the TE path does not build yet (ConfigError: exit 2)
        load_transformer_engine()  # TE importable, or one line (exit 1)
    check_fits(run, print_fn)  # before any process group, data index or allocation
    check_log_targets(run.logging)
    resolved = report_resolved_config(args, build_parser(), print_fn)
    return training.pretrain(run, tokenizer, print_fn, resolved_config=resolved)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        set_logging_level(args.logging_level)
    except ArgumentError as e:
        sys.stderr.write(f"pretrain_gpt.py: error: {e}\n")
        return 2
    try:
        pretrain(args)
    except USER_ERRORS as e:
        sys.stderr.write(f"pretrain_gpt.py: error: {e}\n")
        return 1
    except UnsavedExit as e:  # a signal, and its checkpoint failed: 128 + the signal
        sys.stderr.write(f"pretrain_gpt.py: error: {e}\n")
        return e.exit_code
    except ConfigError as e:  # flags that validate one by one but cannot run together here
        sys.stderr.write(f"pretrain_gpt.py: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("pretrain_gpt.py: interrupted\n")
        return 130
    return 0
