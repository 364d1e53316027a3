"""The routed experts' grouped GEMMs on TE's GroupedLinear (Megatron's TEGroupedMLP).

megamoe keeps each projection's local experts stacked in one parameter, fc1 [E, H, 2F]
and fc2 [E, F, H] (row-major [in, out] per expert: the grouped-GEMM layout, and what
sharding and checkpoints know). TE's GroupedLinear computes x_e @ weight{e}^T with one
[out, in] tensor per GEMM (Megatron's checkpoint names `linear_fc1.weight{e}`). So the
engine removes GroupedLinear's own weights and, for each call, hands it weight{e} =
fc[e]^T made contiguous (TE's GEMMs take row-major operands): tensors computed from the
stacked parameter inside the autograd graph, so the gradients reach the stacked parameter
and nothing else holds a weight. The cost is that copy: one expert-weight-sized tensor per
projection while its backward is pending (under FP8 TE keeps the quantised copy it makes
anyway). The attributes are removed again after the call, so no copy outlives its graph.

The biases stay megamoe's (added per row by GroupedExperts around the GEMMs), so the
GroupedLinear is built without any. The split sizes are read on the host once per call of
the experts (GroupSizes), as TE's `m_splits` list and as the loop backend.
"""

from __future__ import annotations

import torch

from megamoe.model.te.engine import Engine, no_init
from megamoe.model.te.loader import TransformerEngine
from megamoe.moe.experts import GroupedExperts
from megamoe.moe.grouped_gemm import as_group_sizes


def _grouped_linear(te: TransformerEngine, w_EKM: torch.Tensor):
    num, k, m = w_EKM.shape
    module = te.pytorch.GroupedLinear(num, k, m, bias=False, params_dtype=w_EKM.dtype,
                                      device=w_EKM.device, init_method=no_init)
    for e in range(num):  # TE's own [out, in] weights: replaced per call (module docstring)
        delattr(module, f"weight{e}")
    return module


class TeGroupedGemm:
    """GroupedExperts' GEMM hook `(x_NK, w_EKM, sizes) -> y_NM` on two GroupedLinear
    modules, one per projection, chosen by which stacked parameter is passed."""

    def __init__(self, te: TransformerEngine, experts: GroupedExperts) -> None:
        self.experts = experts
        self.fc1 = Engine(_grouped_linear(te, experts.fc1_weight), experts)
        self.fc2 = Engine(_grouped_linear(te, experts.fc2_weight), experts)

    def modules(self) -> dict[str, torch.nn.Module]:
        return {"linear_fc1": self.fc1.module, "linear_fc2": self.fc2.module}

    def __call__(self, x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes) -> torch.Tensor:
        e = self.experts
        if w_EKM is e.fc1_weight:
            engine = self.fc1
        elif w_EKM is e.fc2_weight:
            engine = self.fc2
        else:
            raise RuntimeError("the experts' weights were replaced after Transformer "
                               "Engine's GroupedLinear was installed")
        engine.sync_mode()
        module, num = engine.module, w_EKM.shape[0]
        try:
            for i in range(num):
                setattr(module, f"weight{i}", w_EKM[i].t().contiguous())
            return module(x_NK, as_group_sizes(sizes).host_list())
        finally:
            for i in range(num):
                module.__dict__.pop(f"weight{i}", None)
