"""Rotary position embedding, rotate-half convention (Megatron, HF Llama/Mixtral).

The first `rot_dim = kv_channels * rotary_percent` channels of every head are rotated in two
halves [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]; the rest pass through unchanged.
Frequencies are computed in fp32 on the fly (cheap, and never cast to bf16 with the model).
"""

from __future__ import annotations

from typing import Optional

import torch


def rotary_dim(kv_channels: int, rotary_percent: float) -> int:
    """Channels of each head that rotate (even and positive: ModelConfig checks it)."""
    return int(kv_channels * rotary_percent)


def rotary_cos_sin(seq_length: int, rot_dim: int, base: float, *,
                   position_ids_BS: Optional[torch.Tensor] = None,
                   device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [S, B or 1, 1, rot_dim] in fp32, broadcastable over [S, B, N, D]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, device=device,
                                            dtype=torch.float32) / rot_dim))
    if position_ids_BS is None:
        pos_S1 = torch.arange(seq_length, device=device, dtype=torch.float32)[:, None]
    else:
        pos_S1 = position_ids_BS.to(device=device, dtype=torch.float32).t()  # [S, B]
    freqs = pos_S1[..., None] * inv_freq  # [S, B|1, rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [S, B|1, 1, rot]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_SBND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of each head of x [S, B, N, D]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x_SBND[..., :rot], x_SBND[..., rot:]
    cos, sin = cos.to(x_SBND.dtype), sin.to(x_SBND.dtype)
    out = x_rot * cos + _rotate_half(x_rot) * sin
    if x_pass.shape[-1] == 0:
        return out
    return torch.cat((out, x_pass), dim=-1)
