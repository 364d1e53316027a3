"""Megatron-LM's run-health flags, with Megatron's names, defaults and meaning
(megatron/training/arguments.py and config/resilience_config.py):

* --check-weight-hash-across-dp-replicas-interval N: the parameters' hashes compared over
  the data-parallel replicas at the start of training and every N iterations
  (training/weight_hash.py);
* --check-for-spiky-loss: a local micro-batch loss >= 10x the largest of this rank's first
  100 counts as spiky (training/spiky_loss.py);
* --rerun-mode: Megatron's rerun state machine. megamoe runs what Megatron's `disabled`
  mode does (a NaN/Inf stops the run: --check-for-nan-in-loss-and-grad; a spiky loss is
  a warning) and makes it its default; Megatron's default `validate_results` and
  `report_stats` (rerunning an iteration in place) are not built and are refused by value,
  as are the error-injection flags that drive them (config/unsupported.py). README and
  docs/run-health.md name this difference.
"""

from __future__ import annotations

import argparse

from megamoe.config import ConfigError

RERUN_MODES = ("disabled", "validate_results", "report_stats")
RERUN_MODE_BUILT = "disabled"  # Megatron's default is validate_results (not built)
ERROR_INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")


def add_runhealth_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("run health (Megatron-LM's)")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="every N iterations (and at the start) compare the parameters' "
                        "hashes over the data-parallel replicas; stop when they differ")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="warn when a local micro-batch loss is >= 10x the largest of the "
                        "rank's first 100")
    g.add_argument("--rerun-mode", default=RERUN_MODE_BUILT, choices=RERUN_MODES,
                   help="Megatron's rerun state machine; megamoe runs disabled (its "
                        "default; Megatron's is validate_results, not supported yet)")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="the rerun state machine's error injection: not supported yet")
    g.add_argument("--error-injection-type", default="transient_error",
                   choices=ERROR_INJECTION_TYPES,
                   help="the rerun state machine's error injection: not supported yet")


def check_rerun_mode(args: argparse.Namespace) -> None:
    """Only the mode that is built runs; another is one line naming flag and value."""
    if args.rerun_mode != RERUN_MODE_BUILT:
        raise ConfigError(f"not supported yet: --rerun-mode {args.rerun_mode} (megamoe "
                             f"runs --rerun-mode {RERUN_MODE_BUILT}: docs/run-health.md)")
