"""The MLP activations Megatron-LM's flags choose (megatron/training/argument_utils.py,
megatron/core/activations.py), shared by the dense MLP, the shared experts and the routed
experts:

  gelu          F.gelu(h)                       exact erf GELU: without linear biases
                                                (--disable-bias-linear) or with
                                                --no-bias-gelu-fusion
  gelu_tanh     F.gelu(h, approximate="tanh")   the default GELU: Megatron's fused
                                                bias_gelu_impl (fused_bias_gelu.py) is
                                                the tanh approximation, and it runs
                                                whenever GELU has biases and the fusion
                                                is on (ModelConfig.activation)
  swiglu        silu(gate) * up                 (--swiglu; gated)
  squared_relu  relu(h)^2                       (--squared-relu)
  quick_geglu   quick_gelu(gate) * up           (--quick-geglu; gated)
                quick_gelu(x) = x * sigmoid(1.702 x)

A gated activation's fc1 output is [gate | up] (2F wide): the gate half first, as
Megatron's glu() chunks it. Megatron's glu_linear_offset (no flag sets it) is 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "squared_relu", "quick_geglu")
GATED = ("swiglu", "quick_geglu")


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's squared_relu: torch.pow(relu(x), 2)."""
    return torch.pow(F.relu(x), 2)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's quick_gelu: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Megatron's bias_gelu: x * 0.5 * (1 + tanh(0.79788456 x (1 + 0.044715 x^2))). torch's
    tanh GELU is that formula (its sqrt(2/pi) rounds to the same fp32 constant), forward
    and backward (tests/model/test_gelu_tanh.py), and runs one fused kernel on CUDA."""
    return F.gelu(x, approximate="tanh")


_ELEMENTWISE = {"gelu": F.gelu, "gelu_tanh": gelu_tanh, "swiglu": F.silu,
                "squared_relu": squared_relu, "quick_geglu": quick_gelu}


def check_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown MLP activation {name!r} (one of {', '.join(ACTIVATIONS)})")
    return name


def is_gated(name: str) -> bool:
    """fc1 computes [gate | up] for this activation."""
    return check_activation(name) in GATED


def apply_activation(name: str, h: torch.Tensor) -> torch.Tensor:
    """fc1's output h [..., F] ([..., 2F] = [gate | up] when gated) -> [..., F]."""
    fn = _ELEMENTWISE[check_activation(name)]
    if name in GATED:
        gate, up = h.chunk(2, dim=-1)
        return fn(gate) * up
    return fn(h)
