"""Mixture-of-Experts settings in three parts:

- `MoEConfig`: what an MoE layer computes (experts' shapes, routing, balancing losses,
  capacity). Part of the model: saved with checkpoints, read by the layer.
- `MoEExecutionConfig`: how MoE layers run (grouped GEMM, token dispatcher, all-to-all
  overlap, adaptive parallelism). Changes speed and summation order, never the model.
- `MoETrainingConfig`: what only training does with them (per-layer logging, upcycling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.config.fields import (
    ConfigError,
    check_positive,
    check_range,
    derived,
    flag,
    flag_name,
    require,
)

BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = ("fp32", "fp64")
ROUTER_TYPES = ("topk", "expert_choice")
DROP_POLICIES = ("probs", "position")
DISPATCHER_TYPES = ("allgather", "alltoall", "flex")


@dataclass
class MoEConfig:
    """What one MoE layer computes: experts, routing, balancing losses and capacity."""

    num_experts: int = flag("--num-experts", 8)
    topk: int = flag("--moe-router-topk", 2)
    ffn_hidden_size: int = flag("--moe-ffn-hidden-size", 2048)  # per-expert intermediate
    shared_expert_intermediate_size: Optional[int] = flag(
        "--moe-shared-expert-intermediate-size", None)
    shared_expert_gate: bool = flag("--moe-shared-expert-gate", False)
    # Router.
    score_function: str = flag("--moe-router-score-function", "softmax")
    pre_softmax: bool = flag("--moe-router-pre-softmax", False)
    topk_scaling_factor: Optional[float] = flag("--moe-router-topk-scaling-factor", None)
    num_groups: Optional[int] = flag("--moe-router-num-groups", None)
    group_topk: Optional[int] = flag("--moe-router-group-topk", None)
    router_dtype: str = flag("--moe-router-dtype", "fp32")
    router_type: str = derived("Python API only: topk (token choice) or expert_choice",
                               "topk")
    input_jitter_eps: Optional[float] = flag("--moe-input-jitter-eps", None)
    # Megatron's benchmarking mode: random logits, balanced load (moe/force_balance.py).
    force_load_balancing: bool = flag("--moe-router-force-load-balancing", False)
    enable_expert_bias: bool = flag("--moe-router-enable-expert-bias", False)
    bias_update_rate: float = flag("--moe-router-bias-update-rate", 1e-3)
    # Load balancing: parallel lists, one coefficient per type.
    load_balancing_types: list[str] = flag("--moe-router-load-balancing-type",
                                           default_factory=lambda: ["aux_loss"])
    aux_loss_coeffs: list[float] = flag("--moe-aux-loss-coeff", default_factory=lambda: [0.0])
    z_loss_coeff: Optional[float] = flag("--moe-z-loss-coeff", None)
    # Capacity (None = dropless). > 0: fixed factor x fair share; Python API also Tutel's
    # 0 = largest needed load (no drops, padded), < 0 = min(needed, |cf| x fair share).
    capacity_factor: Optional[float] = flag("--moe-expert-capacity-factor", None)
    pad_to_capacity: bool = flag("--moe-pad-expert-input-to-capacity", False)
    token_drop_policy: str = flag("--moe-token-drop-policy", "probs")
    # Not Megatron flags: megamoe's earlier choices, kept behind a name (README, "Where
    # megamoe differs from Megatron-LM"). Under TP + SP, capacity is counted over each TP
    # rank's sequence shard (Megatron) unless this counts it over the gathered sequence.
    capacity_over_tp_gathered_sequence: bool = flag(
        "--moe-capacity-over-tp-gathered-sequence", False)
    # The expert-bias update counts the kept assignments, after capacity drops (Megatron),
    # unless this counts the routed ones, before the drops.
    expert_bias_counts_before_capacity: bool = flag(
        "--moe-expert-bias-counts-before-capacity", False)

    def __post_init__(self) -> None:
        self.validate()

    def aux_loss_coeff(self, kind: str) -> float:
        """Coefficient of balancing loss `kind`, 0.0 when that type is not enabled."""
        return sum(c for t, c in zip(self.load_balancing_types, self.aux_loss_coeffs) if t == kind)

    def validate(self) -> None:
        check_positive(self, "num_experts", "ffn_hidden_size",
                       "shared_expert_intermediate_size")
        require(1 <= self.topk <= self.num_experts,
                f"--moe-router-topk ({self.topk}) must be between 1 and --num-experts "
                f"({self.num_experts})")
        for name, allowed in (("score_function", SCORE_FUNCTIONS),
                              ("router_dtype", ROUTER_DTYPES), ("router_type", ROUTER_TYPES),
                              ("token_drop_policy", DROP_POLICIES)):
            value = getattr(self, name)
            require(value in allowed, f"{flag_name(self, name)} must be one of "
                                      f"{', '.join(allowed)}, got {value!r}")
        self._validate_groups()
        self._validate_balancing()
        check_range(self, "input_jitter_eps", 0, 1)
        check_range(self, "topk_scaling_factor", 0, low_open=True)
        require(not self.pad_to_capacity or self.capacity_factor is not None,
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        require(not self.capacity_over_tp_gathered_sequence or self.capacity_factor is not None,
                "--moe-capacity-over-tp-gathered-sequence needs --moe-expert-capacity-factor")
        require(not self.expert_bias_counts_before_capacity or self.enable_expert_bias,
                "--moe-expert-bias-counts-before-capacity needs "
                "--moe-router-enable-expert-bias")
        require(not self.shared_expert_gate or self.shared_expert_intermediate_size is not None,
                "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")

    def check_router_gradient(self) -> None:
        """Training needs a router the LM loss can train (Megatron's TransformerConfig
        rule): softmax over the one selected logit is 1.0 for every token, so top-1
        post-softmax routing would give each token weight 1.0 and the router no gradient.
        (Forward-only use, e.g. a converted top-1 Mixtral, may still route that way.)"""
        require(not (self.topk == 1 and self.score_function == "softmax"
                     and not self.pre_softmax and self.router_type == "topk"
                     and "sinkhorn" not in self.load_balancing_types),
                "--moe-router-topk 1 with --moe-router-score-function softmax needs "
                "--moe-router-pre-softmax (softmax over one selected logit is 1.0: every "
                "token would get weight 1.0 and the router no gradient)")

    def check_expert_parallel(self, ep: int) -> None:
        """What expert parallelism of size `ep` needs of the layer (the command line checks
        it before any process group exists, the parallelize step for library users)."""
        if ep == 1:
            return
        require(self.router_type == "topk",
                "expert parallelism needs the token-choice (topk) router")
        require(not (self.pad_to_capacity or self.capacity_factor == 0),
                "not supported yet: --moe-pad-expert-input-to-capacity with "
                "--expert-model-parallel-size > 1")

    def _validate_groups(self) -> None:
        groups, group_topk = self.num_groups, self.group_topk
        require((groups is None) == (group_topk is None),
                "--moe-router-num-groups and --moe-router-group-topk must be given together")
        if groups is None:
            return
        require(groups >= 1 and self.num_experts % groups == 0,
                f"--num-experts ({self.num_experts}) must be divisible by "
                f"--moe-router-num-groups ({groups})")
        require(1 <= group_topk <= groups,
                f"--moe-router-group-topk ({group_topk}) must be between 1 and "
                f"--moe-router-num-groups ({groups})")
        per_group = self.num_experts // groups
        require(self.topk <= group_topk * per_group,
                f"--moe-router-topk ({self.topk}) exceeds the experts in the selected "
                f"groups ({group_topk} x {per_group})")

    def _validate_balancing(self) -> None:
        types, coeffs = self.load_balancing_types, self.aux_loss_coeffs
        for kind in types:
            require(kind in BALANCING_TYPES, f"--moe-router-load-balancing-type {kind}: "
                                             f"choose from {', '.join(BALANCING_TYPES)}")
        require(len(coeffs) == len(types),
                f"--moe-aux-loss-coeff has {len(coeffs)} values but "
                f"--moe-router-load-balancing-type has {len(types)}")
        for coeff in coeffs:
            require(coeff >= 0, f"--moe-aux-loss-coeff must be >= 0, got {coeff}")
        check_range(self, "z_loss_coeff", 0)
        if "sinkhorn" in types:  # Megatron: "Sinkhorn routing does not support aux loss."
            require(not any(coeffs), "--moe-aux-loss-coeff must be 0 with "
                                     "--moe-router-load-balancing-type sinkhorn (sinkhorn "
                                     "routing does not support an aux loss)")
            require(self.capacity_factor is None,
                    "--moe-expert-capacity-factor does not work with "
                    "--moe-router-load-balancing-type sinkhorn")
        if "sinkhorn" in types and (self.enable_expert_bias or self.router_type != "topk"):
            raise ConfigError("--moe-router-load-balancing-type sinkhorn cannot be combined "
                              "with --moe-router-enable-expert-bias or expert choice")
        if self.router_type == "expert_choice" and any(
                self.aux_loss_coeff(k) > 0 for k in ("aux_loss", "seq_aux_loss",
                                                     "global_aux_loss")):
            raise ConfigError("expert choice routing is balanced by construction: set the "
                              "aux loss coefficients to 0")
        check_range(self, "bias_update_rate", 0)


@dataclass
class MoEExecutionConfig:
    """How MoE layers run: the same sums in another order or on other ranks."""

    grouped_gemm: bool = flag("--moe-grouped-gemm", False)
    token_dispatcher_type: str = flag("--moe-token-dispatcher-type", "allgather")
    a2a_overlap_degree: int = flag("--moe-a2a-overlap-degree", 1)  # chunks pipelined
    adaptive_parallelism: bool = flag("--moe-adaptive-parallelism", False)  # ep / dp / tp
    # the shared expert computes while the dispatcher's all-to-alls are in flight
    shared_expert_overlap: bool = flag("--moe-shared-expert-overlap", False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        kind = self.token_dispatcher_type
        require(kind in DISPATCHER_TYPES, f"--moe-token-dispatcher-type must be one of "
                                          f"{', '.join(DISPATCHER_TYPES)}, got {kind!r}")
        require(kind != "flex", "not supported yet: --moe-token-dispatcher-type flex")
        overlap = self.a2a_overlap_degree
        require(overlap >= 1, f"--moe-a2a-overlap-degree must be >= 1, got {overlap}")

    def check_shared_expert_overlap(self, shared_experts: bool, recompute_shared: bool
                                    ) -> None:
        """Where Megatron-LM refuses --moe-shared-expert-overlap (TransformerConfig); with
        no shared expert Megatron ignores it, megamoe refuses it (a flag that would do
        nothing)."""
        if not self.shared_expert_overlap:
            return
        require(shared_experts, "--moe-shared-expert-overlap needs shared experts "
                                "(--moe-shared-expert-intermediate-size)")
        require(self.token_dispatcher_type in ("alltoall", "flex"),
                "--moe-shared-expert-overlap only works with --moe-token-dispatcher-type "
                "alltoall or flex")
        require(not recompute_shared, "--recompute-modules shared_experts cannot work with "
                                      "--moe-shared-expert-overlap")
        require(not self.adaptive_parallelism, "not supported yet: --moe-shared-expert-"
                                               "overlap with --moe-adaptive-parallelism")

    def check_layout(self, ep: int, etp: int, expert_biases: bool) -> None:
        """What the layout and the experts must be for these settings (called by the
        command line before any process group exists, and by the parallelize step)."""
        require(self.a2a_overlap_degree == 1 or (self.token_dispatcher_type == "alltoall"
                                                 and ep > 1),
                "--moe-a2a-overlap-degree > 1 needs --moe-token-dispatcher-type alltoall and "
                "--expert-model-parallel-size > 1")
        if not self.adaptive_parallelism:
            return
        require(ep > 1, "--moe-adaptive-parallelism needs --expert-model-parallel-size > 1 "
                        "(it switches how the expert-parallel ranks share work)")
        require(etp == 1, "not supported yet: --moe-adaptive-parallelism with "
                          "--expert-tensor-parallel-size > 1 (set it to 1)")
        require(not expert_biases, "not supported yet: --moe-adaptive-parallelism with "
                                   "expert biases (add --disable-bias-linear)")


@dataclass
class MoETrainingConfig:
    """What training alone does with the MoE layers."""

    per_layer_logging: bool = flag("--moe-per-layer-logging", False)
    use_upcycling: bool = flag("--moe-use-upcycling", False)  # experts start as the dense MLP
