"""Where `--moe-grouped-gemm` puts the experts in megatron-core's flat DP buffers.

With `--transformer-impl transformer_engine` (Megatron-LM's default) `--moe-grouped-gemm`
builds TEGroupedMLP experts (megatron-core 0.19.2 TESpecProvider.grouped_mlp_modules):
its linear_fc1 and linear_fc2 are TE GroupedLinear modules, each registering, for i in
range(local experts), `weight{i}` (then `bias{i}` with bias): Transformer Engine
27486e03, transformer_engine/pytorch/module/grouped_linear.py lines 1450-1482. So a
layer's experts are registered fc1 of every local expert, then fc2 of every one, where
SequentialMLP registers each expert's fc1 and fc2 together (`local_experts.{e}`). Their
checkpoint keys are SequentialMLP's (TEGroupedMLP.sharded_state_dict), so only the order
in the buffers differs: `te_grouped_order` turns megatron_dp_reshard's SequentialMLP order
into TEGroupedMLP's, keeping SequentialMLP's local names (the legacy merge's).

With `--transformer-impl local` megatron-core builds SequentialMLP whatever
`--moe-grouped-gemm` says (LocalSpecProvider.grouped_mlp_modules). Checked against
megatron-core's own TEGroupedMLP on a Transformer Engine stand-in that registers TE's
parameters in TE's order (tests/tools/megatron_peer/te_peer_stand_in/) at EP 1 and 2.
"""

from __future__ import annotations

import re
from typing import Any, Callable

_EXPERT = re.compile(r"(.*)local_experts\.(\d+)\.(linear_fc[12])\.weight")


def te_grouped_experts(args, flag: Callable[[Any, str], bool], refuse: type[Exception],
                       expert_tp: int) -> bool:
    """Whether the saved args describe TEGroupedMLP experts; `refuse` (NotModelled) for a
    grouped layout that was not checked against megatron-core."""
    if not flag(args, "moe_grouped_gemm"):
        return False
    impl = getattr(args, "transformer_impl", "transformer_engine")
    if impl == "local":
        return False  # (SequentialMLP)
    if impl != "transformer_engine":
        raise refuse(f"--moe-grouped-gemm with --transformer-impl {impl!r} is not modelled")
    for name in ("moe_use_legacy_grouped_gemm", "moe_single_grouped_weight",
                 "moe_single_grouped_bias", "add_bias_linear"):
        if flag(args, name):
            raise refuse(f"--moe-grouped-gemm with args.{name} is not modelled")
    if expert_tp > 1:
        raise refuse("--moe-grouped-gemm with expert TP > 1 is not modelled")
    return True


def te_grouped_order(params: list[tuple]) -> list[tuple]:
    """Params (local name first) in SequentialMLP's registration order -> TEGroupedMLP's:
    within each layer's run of expert weights, every expert's linear_fc1, then every
    expert's linear_fc2, experts ascending (a stable sort by the fc's name)."""
    out: list[tuple] = []
    run: list[tuple] = []
    run_layer = None
    for p in params + [(None,)]:
        m = _EXPERT.fullmatch(p[0]) if p[0] is not None else None
        if m is None or m.group(1) != run_layer:
            out += sorted(run, key=lambda q: _EXPERT.fullmatch(q[0]).group(3))
            run, run_layer = [], None
        if m is None:
            if p[0] is not None:
                out.append(p)
            continue
        run.append(p)
        run_layer = m.group(1)
    return out
