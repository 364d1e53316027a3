"""transformer_engine.pytorch for the megatron-core peer: GroupedLinear here and the dense
modules of dense.py (TE's signatures and parameter registration order, plain torch math);
LayerNormMLP (megatron-core's TE spec does not build it for GPT) is a name only (building
it raises)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from transformer_engine.pytorch import distributed, fp8, router, tensor  # noqa: F401
from transformer_engine.pytorch.dense import (  # noqa: F401
    DotProductAttention,
    LayerNorm,
    LayerNormLinear,
    Linear,
    RMSNorm,
)
from transformer_engine.pytorch.distributed import set_tensor_model_parallel_attributes

# TE 27486e03 pytorch/constants.py line 171, GemmParallelModes
_PARALLEL_MODES = ("row", "column", None)


class _NotModelled(nn.Module):
    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"the peer's TE stand-in does not model "
                                  f"transformer_engine.pytorch.{type(self).__name__} (only "
                                  "GroupedLinear and dense.py's modules)")


class LayerNormMLP(_NotModelled):
    pass


class GroupedLinear(nn.Module):
    """TE 27486e03 module/grouped_linear.py `GroupedLinear` (class at line 1284). The
    constructor takes TE's parameters (lines 1356-1381) and registers, as lines 1450-1482
    do, for i in range(num_gemms): `weight{i}` [out, in], then `bias{i}` [out] when bias
    is on (zeros, TE's init_method_constant(0.0)); each initialised by `init_method` under
    `get_rng_state_tracker().fork(rng_tracker_name)` (module/base.py reset_parameters,
    lines 1734-1763); the TP attributes of set_tensor_parallel_attributes (lines
    1616-1657). What TE offers beyond that is refused, not ignored."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None,
                 rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True,
                 return_bias: bool = False, params_dtype: Optional[torch.dtype] = None,
                 parallel_mode: Optional[str] = None, device="cuda",
                 ub_overlap_rs: bool = False, ub_overlap_ag: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 save_original_input: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, name: Optional[str] = None) -> None:
        super().__init__()
        refused = {"fuse_wgrad_accumulation": fuse_wgrad_accumulation,
                   "return_bias": return_bias, "delay_wgrad_compute": delay_wgrad_compute,
                   "single_grouped_weight": single_grouped_weight,
                   "single_grouped_bias": single_grouped_bias,
                   "ub_overlap_rs": ub_overlap_rs, "ub_overlap_ag": ub_overlap_ag}
        if any(refused.values()):
            raise NotImplementedError("the peer's TE stand-in does not model GroupedLinear("
                                      f"{[k for k, v in refused.items() if v]})")
        if parallel_mode not in _PARALLEL_MODES:
            raise ValueError(f"parallel_mode {parallel_mode!r} not supported.")
        self.num_gemms, self.use_bias, self.name = num_gemms, bias, name
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_size = tp_group.size() if tp_group is not None else tp_size
        if self.tp_size > 1 and bias:  # (lines 1425-1429)
            raise ValueError("GroupedLinear doesn't support bias when TP > 1.")
        self.parallel_mode = parallel_mode
        self.in_features, self.out_features = in_features, out_features
        if parallel_mode == "column":
            self.out_features //= self.tp_size
        elif parallel_mode == "row":
            self.in_features //= self.tp_size
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        # TE's FP8 bookkeeping as megatron-core's TEGroupedLinear reads it (no FP8 here)
        self.fp8 = self.fp8_calibration = self.primary_weights_in_fp8 = False
        self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(
                self.out_features, self.in_features, device=device, dtype=self.params_dtype)))
            if bias:
                self.register_parameter(f"bias{i}", nn.Parameter(torch.zeros(
                    self.out_features, device=device, dtype=self.params_dtype)))
        self._initialise(init_method, get_rng_state_tracker, rng_tracker_name)

    def _initialise(self, init_method, get_rng_state_tracker, rng_tracker_name) -> None:
        with torch.no_grad():
            for i in range(self.num_gemms):
                weight = getattr(self, f"weight{i}")
                if init_method is None:
                    nn.init.normal_(weight, std=0.023)  # (TE's default init_method)
                elif get_rng_state_tracker is None:
                    init_method(weight)
                else:
                    tracker = get_rng_state_tracker()
                    with (tracker.fork(rng_tracker_name) if rng_tracker_name
                          else tracker.fork()):
                        init_method(weight)
                set_tensor_model_parallel_attributes(
                    weight, True, 1 if self.parallel_mode == "row" else 0, 1)
                if self.use_bias and self.parallel_mode == "column":
                    set_tensor_model_parallel_attributes(getattr(self, f"bias{i}"), True, 0, 1)
                elif self.use_bias and self.parallel_mode == "row":
                    getattr(self, f"bias{i}").sequence_parallel = self.sequence_parallel

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """Called by megatron-core's load pre-hook; nothing to set up without FP8."""

    def get_extra_state(self) -> torch.Tensor:
        """TE 2.x without FP8 state: an empty uint8 tensor."""
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if isinstance(state, torch.Tensor) and state.numel():
            raise NotImplementedError("the peer's TE stand-in loads no FP8 extra state")

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None,
                out: Optional[torch.Tensor] = None,
                dgrad_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y_i = x_i W_i^T (+ b_i) per GEMM on the rows m_splits gives it, in plain torch."""
        if out is not None or dgrad_out is not None:
            raise NotImplementedError("the peer's TE stand-in takes no out / dgrad_out")
        splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        if len(splits) != self.num_gemms or sum(splits) != inp.shape[0]:
            raise ValueError(f"m_splits {splits}: not {self.num_gemms} counts adding up to "
                             f"{inp.shape[0]} rows")
        return torch.cat([F.linear(x, getattr(self, f"weight{i}"),
                                   getattr(self, f"bias{i}") if self.use_bias else None)
                          for i, x in enumerate(inp.split(splits))])
