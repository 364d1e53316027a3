"""Which runs --transformer-impl transformer_engine can train, checked from the flags
before anything is built (a dry run and the planner accept every combination: they size
the same layers).

Activation recompute and FP8 under TE: a recomputed region must quantise as its forward
did. A full-granularity group replays whole layers, whose forward enters TE's autocast
again: exact for the stateless recipes, but under delayed scaling the replay would record
and reduce amaxes a second time (TE's own checkpoint, which knows its recompute phase, is
not wired). A selective region (mlp, moe, shared_experts) replays inside the layer,
outside the layer's autocast, so it would recompute in high precision: refused under
every FP8 recipe; so would mla_up_proj's (MLA's up projections are recomputed in
backward). (core_attn and moe_act recompute no TE GEMM.)
"""

from __future__ import annotations

from megamoe.config import ConfigError
from megamoe.config.run import RunConfig
from megamoe.model.te.attention import environment_conflict
from megamoe.model.te.recipe import RECIPE_CLASSES

_SELECTIVE_WITH_TE_GEMMS = ("mlp", "moe", "shared_experts", "mla_up_proj")


def _refuse(what: str) -> ConfigError:
    return ConfigError(f"not supported yet: {what} with --transformer-impl transformer_engine")


def check_run(run: RunConfig) -> None:
    """ConfigError (one line naming the flag) for what the TE path does not build yet."""
    p, m = run.parallel, run.model
    if p.tp_comm_overlap and p.tensor_model_parallel_size > 1:
        raise _refuse("--tp-comm-overlap (TE's userbuffers are not wired; megamoe's "
                      "collective matmul bypasses TE's modules)")
    if run.data.reset_attention_mask:
        raise _refuse("--reset-attention-mask")
    if run.train.compile:
        raise _refuse("--compile")
    conflict = environment_conflict(m.attention_backend, m.use_flash_attn)
    if conflict:
        raise ConfigError(conflict)
    selected = run.recompute.selected
    if "layernorm" in selected:
        raise _refuse("--recompute-modules layernorm (TE fuses the norms into the linears)")
    if not run.fp8.enabled:
        return
    if run.fp8.recipe not in RECIPE_CLASSES:  # a recipe TE has no class for (e.g. custom)
        raise _refuse(f"--fp8-recipe {run.fp8.recipe}")
    if run.recompute.granularity == "full" and run.fp8.recipe == "delayed":
        raise _refuse("--recompute-granularity full with --fp8-recipe delayed")
    for module in _SELECTIVE_WITH_TE_GEMMS:
        if module in selected:
            raise _refuse(f"--recompute-modules {module} with --fp8-format")
