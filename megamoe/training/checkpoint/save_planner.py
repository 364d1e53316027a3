"""DCP's save planner for torch_dist saves, as Megatron's checkpoint flags ask.

Which rank writes a tensor that data-parallel replicas share (every replica offers it;
DCP writes it once): by default DCP gives each such tensor to the replica with the least
to write so far, spreading the bytes over the replicas, which is what Megatron's fully
parallel save does (its default). --no-ckpt-fully-parallel-save gives each to the lowest
rank holding it (DefaultSavePlanner's dedup_save_to_lowest_rank), as Megatron without
fully parallel save writes them from the first data-parallel replica.

--ckpt-assume-constant-structure: Megatron caches the save plan between saves whose state
has the same structure. DCP's DefaultSavePlanner(enable_plan_caching=True) does that: the
first save computes and keeps every rank's plan and the global plan (class-level caches,
keyed by `_cached_plans_key`); a later save whose local plans are unchanged reuses the
deduplicated global plan and metadata instead of planning again. The key is one per run
(`SavePlanners`), so two runs in one process (tests, tools) never share a plan. The cache
holds the plan (which rank writes which chunk), never tensor data: every save writes the
values it is given.
"""

from __future__ import annotations

import itertools

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

_RUNS = itertools.count()


class SavePlanners:
    """A fresh DCP save planner for each save of one run (the plan cache is shared by the
    run's saves through its key)."""

    def __init__(self, fully_parallel: bool = True, constant_structure: bool = False) -> None:
        self.fully_parallel, self.constant_structure = fully_parallel, constant_structure
        self.key = f"megamoe-save-plan-{next(_RUNS)}"

    def __call__(self) -> DefaultSavePlanner:
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=not self.fully_parallel,
                                     enable_plan_caching=self.constant_structure)
        planner._cached_plans_key = self.key  # (DCP keys its class-level caches by this)
        return planner
