"""Where megatron-core's Transformer Engine spec registers a layer's dense parameters (so
where its DDP puts them in the flat buffers), against the local spec's order.

`--transformer-impl transformer_engine` (Megatron-LM's default) builds the GPT layer
with megatron-core 0.19.2's TESpecProvider: the attention's input norm fused into
`self_attention.linear_qkv` and a dense MLP's pre-MLP norm into `mlp.linear_fc1` (TE
LayerNormLinear, input_layernorm / pre_mlp_layernorm IdentityOp), a MoE layer's
pre_mlp_layernorm and qk-layernorm TENorm modules of their own. The checkpoint keys are
the same under both specs (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`),
but the local spec registers those norms as `input_layernorm` (before self_attention) and
`pre_mlp_layernorm` (before mlp), while TE registers them inside the fused module: after
`self_attention.linear_proj` (megatron-core's Attention builds linear_proj before
SelfAttention builds linear_qkv), and within the module first: LayerNormLinear registers
`layer_norm_weight`, `layer_norm_bias` (LayerNorm only), then `weight`, `bias`
(Transformer Engine 27486e03 transformer_engine/pytorch/module/layernorm_linear.py lines
1420-1436 and 1519-1541).

Checked against megatron-core's own TE spec built on the peer's TE stand-in
(tests/tools/megatron_peer/te_peer_stand_in/: TE's registration order, plain torch math)
with RMSNorm, no linear biases, qk-layernorm, a dense first layer, SequentialMLP or
TEGroupedMLP experts. MLA and MTP under the TE spec (other fused modules) are refused.
"""

from __future__ import annotations

from typing import Any, Callable

# TE LayerNormLinear's own parameters, in the order it registers them
_FUSED_OWN = {"layer_norm_weight": 0, "layer_norm_bias": 1, "weight": 2, "bias": 3}


def te_dense_order(args, flag: Callable[[Any, str], bool], refuse: type[Exception],
                   mtp: bool) -> bool:
    """Whether the saved args describe the TE spec's dense order (Megatron-LM's default
    impl when the args do not say); `refuse` (NotModelled) for what was not checked."""
    impl = getattr(args, "transformer_impl", "transformer_engine")
    if impl == "local":
        return False
    if impl != "transformer_engine":
        raise refuse(f"--transformer-impl {impl!r} is not modelled")
    if flag(args, "multi_latent_attention"):
        raise refuse("MLA with --transformer-impl transformer_engine is not modelled (only "
                     "the local spec's MLA order is checked against megatron-core)")
    if mtp:
        raise refuse("MTP with --transformer-impl transformer_engine is not modelled")
    return True


def module_path(rest: str, te: bool, local_norms: dict[str, str]) -> list[str]:
    """A layer key's module path as the spec registers it: under the local spec the fused
    norm keys belong to input_layernorm / pre_mlp_layernorm (`local_norms`), under TE to
    linear_qkv / linear_fc1 themselves."""
    return (rest if te else local_norms.get(rest, rest)).split(".")


def own_order(own: list[str], te: bool) -> list[str]:
    """A module's own parameters: TE LayerNormLinear's in TE's order (its norm first)."""
    if not te or not any(r.rsplit(".", 1)[-1].startswith("layer_norm_") for r in own):
        return own
    return sorted(own, key=lambda r: _FUSED_OWN.get(r.rsplit(".", 1)[-1], len(_FUSED_OWN)))
