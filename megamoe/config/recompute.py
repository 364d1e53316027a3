"""Activation recompute (Megatron-LM's --recompute-* flags and meanings).

Two granularities, as in Megatron:
- full: whole transformer layers keep only their input; `method` picks which layers of each
  pipeline stage (model chunk): "uniform" checkpoints consecutive groups of `num_layers`
  layers, "block" checkpoints the first `num_layers` layers one by one and runs the rest
  normally;
- selective: the named `modules` of every layer are recomputed ("core_attn" by default).

What each selective module means here (megamoe/parallel/checkpointing.py does the work):
  core_attn, mlp (dense layers only), moe (the whole MoE layer, its all-to-all replayed),
  shared_experts: normal checkpointing (keep the inputs, rerun the forward in backward);
  moe_act (needs --moe-grouped-gemm, as Megatron), layernorm: output-discarding (the
  activation's or norm's output is not kept by its consumer and is recomputed from the
  input, which is kept anyway), so no GEMM is rerun;
  mla_up_proj (multi-latent attention only): output-discarding over MLA's up projections
  and RoPE: q, k, v are not kept for core attention and are recomputed in backward (the
  up-projection GEMMs run twice, as Megatron).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.config.fields import ConfigError, flag, require

SELECTIVE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts")


@dataclass
class RecomputeConfig:
    granularity: Optional[str] = flag("--recompute-granularity", None)  # full | selective
    method: Optional[str] = flag("--recompute-method", None)  # uniform | block (full only)
    num_layers: Optional[int] = flag("--recompute-num-layers", None)  # full only
    # None = Megatron's default ["core_attn"] when selective.
    modules: Optional[list[str]] = flag("--recompute-modules", None)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Megatron's TransformerConfig rules, plus: a recompute flag that would change
        nothing (a method without full granularity, modules without selective) is an error
        instead of being ignored."""
        g = self.granularity
        require(g in (None, "full", "selective"),
                f"--recompute-granularity must be full or selective, got {g!r}")
        require(self.method in (None, "uniform", "block"),
                f"--recompute-method must be uniform or block, got {self.method!r}")
        if g == "full":
            require(self.method is not None, "--recompute-granularity full needs "
                    "--recompute-method uniform or block")
            require(self.num_layers is not None, "--recompute-granularity full needs "
                    "--recompute-num-layers")
            require(self.num_layers >= 1, f"--recompute-num-layers must be >= 1, got "
                    f"{self.num_layers}")
            require(self.modules is None, "--recompute-modules needs "
                    "--recompute-granularity selective")
            return
        if g == "selective":
            require(self.method is None, "--recompute-method is for --recompute-granularity "
                    "full only (selective recomputes the --recompute-modules)")
            require(self.num_layers is None, "--recompute-num-layers is for "
                    "--recompute-granularity full only")
            unknown = sorted(set(self.selected) - set(SELECTIVE_MODULES))
            require(not unknown, f"--recompute-modules: unknown {', '.join(unknown)} (choose "
                    f"from {', '.join(SELECTIVE_MODULES)})")
            return
        for name, value in (("--recompute-method", self.method),
                            ("--recompute-num-layers", self.num_layers),
                            ("--recompute-modules", self.modules)):
            if value is not None:
                raise ConfigError(f"{name} needs --recompute-granularity")

    @property
    def selected(self) -> tuple[str, ...]:
        """The selective modules in effect (none unless granularity is selective)."""
        if self.granularity != "selective":
            return ()
        return tuple(dict.fromkeys(["core_attn"] if self.modules is None else self.modules))

    @property
    def enabled(self) -> bool:
        return self.granularity is not None and (self.granularity == "full"
                                                 or bool(self.selected))

    def full_layers(self, num_local_layers: int) -> list[list[int]]:
        """Full granularity: the groups of local layer indices checkpointed together
        (Megatron's TransformerBlock._checkpointed_forward, per model chunk); layers in no
        group run normally."""
        if self.granularity != "full":
            return []
        n = self.num_layers
        if self.method == "uniform":
            return [list(range(i, min(i + n, num_local_layers)))
                    for i in range(0, num_local_layers, n)]
        return [[i] for i in range(min(n, num_local_layers))]
