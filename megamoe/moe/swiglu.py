"""Fused SwiGLU (+ combine-weight scale) that keeps only fc1's output for backward.

Unfused, autograd keeps fc1's output h [N, 2F] (silu's input and `up`), silu(gate) [N, F]
for the product, and silu(gate) * up [N, F] for the combine-weight multiply: 2F extra
values per row on top of h. This op saves h (and the [N] weights) only and recomputes
silu(gate) in backward, one elementwise pass over [N, F] (MegaBlocks-style memory trade).
The arithmetic is the unfused path's, op for op, so forward and gradients match it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    """a_NF = silu(h[:, :F]) * h[:, F:] (* probs_N[:, None]); saves h_N2F and probs_N."""

    @staticmethod
    def forward(ctx, h_N2F: torch.Tensor, probs_N: Optional[torch.Tensor]) -> torch.Tensor:
        gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
        a_NF = F.silu(gate_NF).mul_(up_NF)
        if probs_N is not None:
            a_NF.mul_(probs_N.unsqueeze(-1))
        ctx.save_for_backward(h_N2F, probs_N)
        return a_NF

    @staticmethod
    def backward(ctx, grad_NF: torch.Tensor):
        h_N2F, probs_N = ctx.saved_tensors
        gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
        silu_NF = F.silu(gate_NF)
        grad_probs = None
        grad_a_NF = grad_NF
        if probs_N is not None:
            if ctx.needs_input_grad[1]:
                grad_probs = (grad_NF * (silu_NF * up_NF)).sum(dim=-1)
            grad_a_NF = grad_NF * probs_N.unsqueeze(-1)
        if not ctx.needs_input_grad[0]:
            return None, grad_probs
        grad_h_N2F = torch.empty_like(h_N2F, memory_format=torch.contiguous_format)
        grad_gate_NF, grad_up_NF = grad_h_N2F.chunk(2, dim=-1)
        torch.mul(grad_a_NF, silu_NF, out=grad_up_NF)
        del silu_NF
        torch.ops.aten.silu_backward.grad_input(grad_a_NF * up_NF, gate_NF,
                                                grad_input=grad_gate_NF)
        return grad_h_N2F, grad_probs


def swiglu(h_N2F: torch.Tensor, probs_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(gate) * up for h = [gate | up] (fc1's fused output), each row optionally scaled
    by probs_N (same dtype as h): the combine weight folded in before fc2."""
    if h_N2F.shape[-1] % 2:
        raise ValueError(f"swiglu: last dim {h_N2F.shape[-1]} is not [gate | up] (odd)")
    if probs_N is not None and probs_N.shape != h_N2F.shape[:-1]:
        raise ValueError(f"swiglu: probs {tuple(probs_N.shape)} for rows "
                         f"{tuple(h_N2F.shape[:-1])}")
    return _SwiGLU.apply(h_N2F, probs_N)
