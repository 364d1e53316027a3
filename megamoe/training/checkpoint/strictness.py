"""Megatron's --dist-ckpt-strictness for torch_dist loads (its StrictHandling).

Megatron's words, kept here: an "unexpected" key is one the model asks for that the
checkpoint lacks; a "missing" key is in the checkpoint but not asked for by any rank.
  assume_ok_unexpected (default), raise_unexpected: an unexpected key stops the load
      (one line naming it); missing keys are ignored.
  raise_all: an unexpected or a missing key stops the load, before any tensor is read.
  log_unexpected / log_all: unexpected (and, for log_all, missing) keys are logged at
      WARNING level and the load goes on.
  return_unexpected / return_all: the same keys are returned in the common state
      ("key_mismatch") without a log line.
  ignore_all: the load goes on silently.
Where the load goes on, an unexpected model parameter keeps the value the model was built
with (Megatron hands the same gap to its own model.load_state_dict). Only model keys are
judged: optimizer state that the checkpoint lacks still stops the load (pass
--no-load-optim to start the optimizer afresh), since a half-loaded optimizer state would
be silently wrong. The *_all modes gather every rank's requested keys (one
all_gather_object on the world group, at load time only).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch.distributed as dist

from megamoe.training.checkpoint.safe_load import CheckpointError

LOG = logging.getLogger("megamoe.checkpoint")
STOP_ON_UNEXPECTED = ("assume_ok_unexpected", "raise_unexpected", "raise_all")


class KeyMismatch:
    """The unexpected and missing model keys of one load, handled per --dist-ckpt-strictness."""

    def __init__(self, strictness: str, ckpt_dir: str) -> None:
        self.strictness, self.ckpt_dir = strictness, ckpt_dir
        self.unexpected: list[str] = []
        self.missing: list[str] = []

    def tolerate_absent(self, key: str) -> bool:
        """The model asks for `key` and the checkpoint lacks it: raise, or note it and
        return True (the caller skips it)."""
        if self.strictness in STOP_ON_UNEXPECTED:
            raise CheckpointError(f"{self.ckpt_dir}: does not match the model (missing {key}; "
                                  "--dist-ckpt-strictness log_unexpected loads the rest)")
        self.unexpected.append(key)
        return True

    def check_missing(self, saved: Iterable[str], requested: Iterable[str],
                      distributed: bool) -> None:
        """*_all modes: checkpoint model keys no rank asked for."""
        if not self.strictness.endswith("_all") or self.strictness == "ignore_all":
            return
        asked = set(requested)
        if distributed:
            every: list[Optional[set]] = [None] * dist.get_world_size()
            dist.all_gather_object(every, asked)
            asked = set().union(*every)
        self.missing = sorted(k for k in saved if k.startswith("model.") and k not in asked)
        if self.missing and self.strictness == "raise_all":
            raise CheckpointError(f"{self.ckpt_dir}: holds {len(self.missing)} model tensors "
                                  f"this model does not have (first: {self.missing[0]}); "
                                  "--dist-ckpt-strictness raise_all")

    def report(self) -> dict:
        """Log (log_*) and return (for the common state's "key_mismatch")."""
        if self.strictness.startswith("log_"):
            for key in self.unexpected:
                LOG.warning("%s: not in the checkpoint, keeps its initial value: %s",
                            self.ckpt_dir, key)
            for key in self.missing:
                LOG.warning("%s: in the checkpoint, not in the model: %s", self.ckpt_dir, key)
        return {"unexpected": list(self.unexpected), "missing": list(self.missing)}
