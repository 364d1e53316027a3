"""TE's dense modules as megatron-core's TE spec builds them, for the peer (TE stand-in):
Linear, LayerNormLinear, RMSNorm / LayerNorm (megatron-core's TENorm) and
DotProductAttention. Each takes TE 27486e03's constructor arguments and REGISTERS ITS
PARAMETERS IN TE'S ORDER (cited per class), which is what fixes where megatron-core's DDP
puts them in its flat buffers; the math is plain torch (fused norm, then the GEMM; TE's
TP communication as tp_comm.py's autograd functions), NOT TE's kernels. A TE feature that
is not modelled raises instead of being ignored.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from transformer_engine.pytorch.distributed import set_tensor_model_parallel_attributes
from transformer_engine.pytorch.tp_comm import enter_column, leave_row

_PARALLEL_MODES = ("row", "column", None)  # TE 27486e03 pytorch/constants.py line 171


def _refuse(module: str, **features) -> None:
    on = [k for k, v in features.items() if v]
    if on:
        raise NotImplementedError(f"the peer's TE stand-in does not model {module}({on})")


class _TEModule(nn.Module):
    """TE's TransformerEngineBaseModule as megatron-core's wrappers read it without FP8."""

    def _no_fp8(self) -> None:
        self.fp8 = self.fp8_calibration = self.primary_weights_in_fp8 = False
        self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """Called by megatron-core's load pre-hook; nothing to set up without FP8."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)  # (TE 2.x without FP8 state)

    def set_extra_state(self, state) -> None:
        if isinstance(state, torch.Tensor) and state.numel():
            raise NotImplementedError("the peer's TE stand-in loads no FP8 extra state")


def _norm(x: torch.Tensor, weight, bias, eps: float, zero_centered: bool,
          normalization: str) -> torch.Tensor:
    """TE's LayerNorm / RMSNorm in fp32 (gamma + 1 when zero-centred), cast back."""
    w = weight.float() + 1 if zero_centered else weight.float()
    xf = x.float()
    if normalization == "RMSNorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
    else:
        y = F.layer_norm(xf, xf.shape[-1:], w, bias.float(), eps)
    return y.to(x.dtype)


class _Linear(_TEModule):
    """What Linear and LayerNormLinear share: TP sizes, the GEMM weight and bias, TP
    attributes and init (module/base.py reset_parameters, lines 1734-1763: init_method
    under get_rng_state_tracker().fork(), biases zero), the forward's GEMM and comms."""

    def _linear_setup(self, in_features, out_features, sequence_parallel, tp_group,
                      tp_size, parallel_mode, bias, return_bias, params_dtype) -> None:
        if parallel_mode not in _PARALLEL_MODES:
            raise ValueError(f"parallel_mode {parallel_mode!r} not supported.")
        self._no_fp8()
        self.tp_group, self.parallel_mode = tp_group, parallel_mode
        self.tp_size = tp_group.size() if tp_group is not None else tp_size
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self.use_bias, self.return_bias = bias, return_bias
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        if parallel_mode == "column":
            self.out_features //= self.tp_size
        elif parallel_mode == "row":
            self.in_features //= self.tp_size

    def _register_linear(self, device, init_method, get_rng_state_tracker,
                         rng_tracker_name) -> None:
        self.register_parameter("weight", nn.Parameter(torch.empty(
            self.out_features, self.in_features, device=device, dtype=self.params_dtype)))
        if self.use_bias:
            self.register_parameter("bias", nn.Parameter(torch.zeros(
                self.out_features, device=device, dtype=self.params_dtype)))
        else:
            self.bias = torch.Tensor().to(dtype=self.params_dtype, device=device)
        with torch.no_grad():
            if init_method is None:
                nn.init.normal_(self.weight, std=0.023)  # (TE's default init_method)
            elif get_rng_state_tracker is None:
                init_method(self.weight)
            else:
                tracker = get_rng_state_tracker()
                with tracker.fork(rng_tracker_name) if rng_tracker_name else tracker.fork():
                    init_method(self.weight)
        if self.parallel_mode in ("column", "row"):  # (base.py lines 1616-1657)
            set_tensor_model_parallel_attributes(
                self.weight, True, 0 if self.parallel_mode == "column" else 1, 1)
        if self.use_bias and self.parallel_mode == "column":
            set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        elif self.use_bias and self.parallel_mode == "row":
            self.bias.sequence_parallel = self.sequence_parallel

    def _gemm(self, x: torch.Tensor):
        if self.parallel_mode == "column":
            x = enter_column(x, self.tp_group, self.tp_size, self.sequence_parallel)
        y = F.linear(x, self.weight)
        if self.parallel_mode == "row":
            y = leave_row(y, self.tp_group, self.tp_size, self.sequence_parallel)
        if not self.use_bias:
            return (y, self.bias) if self.return_bias else y
        if self.return_bias:
            return y, self.bias
        return y + self.bias


class Linear(_Linear):
    """TE 27486e03 module/linear.py `Linear` (class at line 1400; constructor lines
    1487-1513): registers `weight` [out, in] then `bias` [out] (lines 1699-1718; without
    bias an empty tensor attribute, not a parameter)."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None,
                 rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True,
                 return_bias: bool = False, params_dtype: Optional[torch.dtype] = None,
                 parallel_mode: Optional[str] = None, parameters_split=None, device="cuda",
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_name: Optional[str] = None,
                 delay_wgrad_compute: bool = False, symmetric_ar_type: Optional[str] = None,
                 save_original_input: bool = False, name: Optional[str] = None) -> None:
        super().__init__()
        _refuse("Linear", fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                parameters_split=parameters_split, ub_overlap_ag=ub_overlap_ag,
                ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
                delay_wgrad_compute=delay_wgrad_compute, symmetric_ar_type=symmetric_ar_type,
                save_original_input=save_original_input)
        self.name = name
        self._linear_setup(in_features, out_features, sequence_parallel, tp_group, tp_size,
                           parallel_mode, bias, return_bias, params_dtype)
        self._register_linear(device, init_method, get_rng_state_tracker, rng_tracker_name)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        _refuse("Linear.forward", fp8_output=fp8_output, fp8_grad=fp8_grad)
        return self._gemm(inp)


class LayerNormLinear(_Linear):
    """TE 27486e03 module/layernorm_linear.py `LayerNormLinear` (class at line 1178;
    constructor lines 1277-1307): registers `layer_norm_weight` [in] (ones, zeros when
    zero-centred), `layer_norm_bias` [in] unless RMSNorm (lines 1420-1436), then `weight`
    [out, in] and `bias` [out] (lines 1519-1541). Forward: the norm on the local input,
    then column-parallel TE's comms and the GEMM."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None,
                 init_method: Optional[Callable] = None, bias: bool = True,
                 normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None,
                 parallel_mode: Optional[str] = None, return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, parameters_split=None,
                 zero_centered_gamma: bool = False, device="cuda",
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_name: Optional[str] = None,
                 delay_wgrad_compute: bool = False, symmetric_ar_type: Optional[str] = None,
                 name: Optional[str] = None) -> None:
        super().__init__()
        _refuse("LayerNormLinear", fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                return_layernorm_output=return_layernorm_output,
                return_layernorm_output_gathered=return_layernorm_output_gathered,
                parameters_split=parameters_split, ub_overlap_ag=ub_overlap_ag,
                ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                ub_bulk_wgrad=ub_bulk_wgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                delay_wgrad_compute=delay_wgrad_compute, symmetric_ar_type=symmetric_ar_type,
                row_parallel=parallel_mode == "row")
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError("Unsupported normalization type!")
        self.name, self.eps, self.normalization = name, eps, normalization
        self.zero_centered_gamma = zero_centered_gamma
        self._linear_setup(in_features, out_features, sequence_parallel, tp_group, tp_size,
                           parallel_mode, bias, return_bias, params_dtype)
        dtype = self.params_dtype
        self.register_parameter("layer_norm_weight", nn.Parameter(torch.full(
            (in_features,), float(not zero_centered_gamma), device=device, dtype=dtype)))
        if normalization != "RMSNorm":
            self.register_parameter("layer_norm_bias", nn.Parameter(torch.zeros(
                in_features, device=device, dtype=dtype)))
        else:
            self.layer_norm_bias = None
        self._register_linear(device, init_method, get_rng_state_tracker, None)
        # (reset_parameters, lines 1619-1626)
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if self.layer_norm_bias is not None:
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        _refuse("LayerNormLinear.forward", fp8_output=fp8_output, fp8_grad=fp8_grad)
        return self._gemm(_norm(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                                self.zero_centered_gamma, self.normalization))


class _Norm(_TEModule):
    """TE's RMSNorm / LayerNorm modules (TE 27486e03 module/rmsnorm.py line 63 and
    module/layernorm.py line 59) over ops/basic/rmsnorm.py (registers `weight`, line 103)
    and ops/basic/layer_norm.py (`weight` then `bias`, lines 112-113)."""

    normalization = ""

    def __init__(self, normalized_shape=None, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, hidden_size: Optional[int] = None,
                 device="cuda", dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self._no_fp8()
        size = normalized_shape if normalized_shape is not None else hidden_size
        if not isinstance(size, int):
            raise NotImplementedError(f"the peer's TE stand-in normalises one dim, not {size}")
        dtype = dtype or params_dtype or torch.get_default_dtype()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        self.register_parameter("weight", nn.Parameter(torch.full(
            (size,), float(not zero_centered_gamma), device=device, dtype=dtype)))
        if self.normalization == "LayerNorm":
            self.register_parameter("bias", nn.Parameter(torch.zeros(
                size, device=device, dtype=dtype)))
        else:
            self.bias = None
        if sequence_parallel is not None:  # (rmsnorm.py lines 140-142, layernorm.py 136-139)
            for p in self.parameters():
                p.sequence_parallel = sequence_parallel

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return _norm(inp, self.weight, self.bias, self.eps, self.zero_centered_gamma,
                     self.normalization)


class RMSNorm(_Norm):
    normalization = "RMSNorm"


class LayerNorm(_Norm):
    normalization = "LayerNorm"


class DotProductAttention(_TEModule):
    """TE 27486e03 attention/dot_product_attention/dot_product_attention.py
    `DotProductAttention` (class at line 199, constructor lines 370-394): no parameters
    with softmax_type "vanilla" (only "learnable" registers `softmax_offset`, lines
    461-472; refused here). Math: softmax(q k^T * scale + mask) v per local head, `sbhd`,
    GQA by repeating the key/value groups; causal masks top-left (TE ignores
    attention_mask then), padding / arbitrary use attention_mask (True = masked)."""

    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups=None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size=None, bottom_right_diagonal=None,
                 sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, tp_group=None,
                 layer_number: Optional[int] = None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type: str = "p2p", softmax_scale: Optional[float] = None,
                 softmax_type: str = "vanilla", return_max_logit: bool = False,
                 name: Optional[str] = None) -> None:
        super().__init__()
        _refuse("DotProductAttention", attention_dropout=attention_dropout,
                window_size=window_size, cp_group=cp_group, other_format=qkv_format != "sbhd",
                softmax_type=softmax_type != "vanilla", return_max_logit=return_max_logit,
                cross_attention=attention_type != "self")
        self._no_fp8()
        tp = tp_group.size() if tp_group is not None else tp_size
        self.heads = num_attention_heads // tp
        self.groups = (num_gqa_groups or num_attention_heads) // tp
        d = kv_channels[0] if isinstance(kv_channels, tuple) else kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        self.attn_mask_type = attn_mask_type

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None,
                qkv_format=None, attn_mask_type: Optional[str] = None,
                core_attention_bias_type: str = "no_bias", **unsupported) -> torch.Tensor:
        used = {k: v for k, v in unsupported.items() if v not in (None, False, 1, True)}
        _refuse("DotProductAttention.forward", other_format=qkv_format not in (None, "sbhd"),
                attention_bias=core_attention_bias_type != "no_bias", **used)
        mask_type = attn_mask_type or self.attn_mask_type
        s, b, h, _ = query_layer.shape
        rep = self.heads // self.groups
        k = key_layer.repeat_interleave(rep, dim=2)
        v = value_layer.repeat_interleave(rep, dim=2)
        scores = torch.einsum("sbhd,tbhd->bhst", query_layer.float(), k.float()) * self.scale
        if mask_type == "causal":
            scores = scores.masked_fill(torch.ones(s, k.shape[0], dtype=torch.bool,
                                                   device=scores.device).triu(1), float("-inf"))
        elif mask_type in ("padding", "arbitrary"):
            scores = scores.masked_fill(attention_mask, float("-inf"))
        elif mask_type != "no_mask":
            raise NotImplementedError(f"the peer's TE stand-in: attn_mask_type {mask_type!r}")
        out = torch.einsum("bhst,tbhv->sbhv", scores.softmax(-1), v.float())
        return out.to(query_layer.dtype).reshape(s, b, -1)
