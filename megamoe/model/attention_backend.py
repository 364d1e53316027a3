"""Megatron's --attention-backend mapped onto PyTorch SDPA's kernels.

Megatron picks among Transformer Engine's attention implementations; megamoe runs SDPA and
restricts which of its kernels may run:
  flash   -> FLASH_ATTENTION (takes no mask: refused with --reset-attention-mask);
  fused   -> CUDNN_ATTENTION or EFFICIENT_ATTENTION (TE's cuDNN fused attention; CUDA only);
  unfused -> MATH (TE's unfused attention: scores, softmax, dropout, x V);
  local   -> MATH (Megatron's own local DotProductAttention computes the same);
  auto    -> whatever SDPA picks (Megatron's auto lets TE pick); with --use-flash-attn and
             no mask, flash only, as before.
SDPA raises when the chosen kernel cannot run the inputs; it never falls back silently.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "unfused": [SDPBackend.MATH],
    "local": [SDPBackend.MATH],
    "auto": None,
}


def sdpa_kernels(backend: str, use_flash_attn: bool, has_mask: bool
                 ) -> Optional[list[SDPBackend]]:
    """The SDPA kernels allowed (None: any)."""
    if backend == "auto":
        return [SDPBackend.FLASH_ATTENTION] if use_flash_attn and not has_mask else None
    return KERNELS[backend]


def is_flash_only(backend: str, use_flash_attn: bool, has_mask: bool) -> bool:
    return sdpa_kernels(backend, use_flash_attn, has_mask) == [SDPBackend.FLASH_ATTENTION]


def kernel_context(backend: str, use_flash_attn: bool, has_mask: bool) -> ContextManager:
    kernels = sdpa_kernels(backend, use_flash_attn, has_mask)
    return contextlib.nullcontext() if kernels is None else sdpa_kernel(kernels)
