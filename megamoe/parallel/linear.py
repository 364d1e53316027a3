"""Linear and embedding layers (one rank) that initialise themselves once, Megatron style.

They are what tensor_parallel.py's layers are with a single rank, and draw the same
numbers.

`nn.Linear`/`nn.Embedding` run their own (kaiming / normal(0, 1)) init in the constructor
and would then be re-initialised: that wastes RNG draws and time on big models. These
layers draw exactly one normal(0, std) per weight, in construction order, so the same seed
always gives the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W^T (+ b). weight [out, in] ~ normal(0, init_std); bias zero."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, init_std: float):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.init_stds = {"weight": init_std}  # (what a meta-built model draws)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.fp8 = None  # an FP8 GEMM (x, W, b) -> y set by the FP8 policy (model/fp8/)
        nn.init.normal_(self.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Embedding(nn.Module):
    """Lookup table [num, dim] ~ normal(0, init_std)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float):
        super().__init__()
        self.init_stds = {"weight": init_std}
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        nn.init.normal_(self.weight, mean=0.0, std=init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"
