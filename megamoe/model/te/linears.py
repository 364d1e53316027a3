"""Dense linears on TE's Linear and LayerNormLinear, installed as the layers' GEMM hook.

megamoe's Column/RowParallelLinear and Linear call `self.fp8(x, weight, bias)` in place of
F.linear when a policy set one (model/fp8/policy.py sets FP8 GEMMs there): the TE engines
use the same hook, so the layers, their TP collectives and their parameters stay as they
are. Row-parallel layers pass no bias (they add it after the TP reduction), so their TE
Linear is built without one.

`LayerNormLinear` fuses the norm in front of a linear, as Megatron's TE spec
(TELayerNormColumnParallelLinear for `linear_qkv` and a dense MLP's `linear_fc1`): the TE
module's `layer_norm_weight` (and `layer_norm_bias` under LayerNorm) *are* the layer's
`input_layernorm` / `pre_mlp_layernorm` parameters, and the transformer layer skips its
own norm (`TransformerLayer.fused_input_norm` / `fused_pre_mlp_norm`). Checkpoints keep
megamoe's names (`input_layernorm.weight`); Megatron's TE-spec name
`linear_qkv.layer_norm_weight` is written by tools/checkpoint's Megatron export.

Under tensor parallelism the column layer hands the hook its input inside the TP region,
so TE's fused norm runs there, on every TP rank (on the gathered sequence under SP: a
per-token norm commutes with the gather). The norm's weight (and bias) gradient on a rank
then comes only from that rank's output columns: `TeNormLinearGemm` marks them for the
gradient reduction's sum over TP (`mark_tp_partial`, the mark sequence parallelism and
per-head q/k norms use; under SP they are marked already). The mark is read by that sum
only (training/optim), not by checkpoints or the grad norm's counting.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Optional

import torch
from torch import nn

from megamoe.model.norms import LayerNorm, RMSNorm
from megamoe.model.te.engine import Engine, no_init, share
from megamoe.model.te.loader import TransformerEngine
from megamoe.parallel.tensor_parallel import mark_tp_partial


def _common_kwargs(weight: torch.Tensor) -> dict:
    return dict(params_dtype=weight.dtype, device=weight.device, init_method=no_init)


class TeLinearGemm(Engine):
    """The GEMM hook of a linear layer (`owner`: a megamoe linear with `weight`, `bias`) on
    TE's Linear. `autocast`: a context to enter around the call (a GEMM outside any
    transformer layer's, MTP's eh_proj), else None."""

    def __init__(self, te: TransformerEngine, owner: nn.Module, *, bias: bool,
                 autocast: Optional[Callable[[], ContextManager]] = None) -> None:
        out_features, in_features = owner.weight.shape
        module = te.pytorch.Linear(in_features, out_features, bias=bias,
                                   **_common_kwargs(owner.weight))
        share(module, "weight", owner.weight)
        if bias:
            share(module, "bias", owner.bias)
        super().__init__(module, owner)
        self.autocast = autocast

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
        self.check_same("weight", weight)
        self.check_same("bias", bias)
        self.sync_mode()
        if self.autocast is None:
            return self.module(x)
        with self.autocast():
            return self.module(x)


def norm_kind(norm: nn.Module) -> str:
    """TE's `normalization` for a megamoe norm module."""
    if isinstance(norm, RMSNorm):
        return "RMSNorm"
    if isinstance(norm, (LayerNorm, nn.LayerNorm)):
        return "LayerNorm"
    raise ValueError(f"not supported yet: --transformer-impl transformer_engine with a "
                     f"{type(norm).__name__} norm")


class TeNormLinearGemm(Engine):
    """The GEMM hook of a column linear whose input norm TE fuses (LayerNormLinear): the
    layer hands it the un-normalised input (under TP the norm's gradient is partial:
    summed over TP, module docstring)."""

    def __init__(self, te: TransformerEngine, norm: nn.Module, owner: nn.Module) -> None:
        out_features, in_features = owner.weight.shape
        kind = norm_kind(norm)
        module = te.pytorch.LayerNormLinear(
            in_features, out_features, eps=norm.eps, bias=owner.bias is not None,
            normalization=kind, **_common_kwargs(owner.weight))
        share(module, "layer_norm_weight", norm.weight)
        if kind == "LayerNorm":
            share(module, "layer_norm_bias", norm.bias)
        share(module, "weight", owner.weight)
        share(module, "bias", owner.bias)
        mark_tp_partial(norm, owner.tp)
        super().__init__(module, owner)
        self.norm = norm

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
        self.check_same("weight", weight)
        self.check_same("bias", bias)
        if self.module.layer_norm_weight is not self.norm.weight:
            raise RuntimeError("the fused norm's weight was replaced after Transformer "
                               "Engine's LayerNormLinear was installed")
        self.sync_mode()
        return self.module(x)
