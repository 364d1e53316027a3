"""Rotary position embedding, rotate-half convention (Megatron, HF Llama/Mixtral).

The first `rot_dim = kv_channels * rotary_percent` channels of every head are rotated in two
halves [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]; the rest pass through unchanged.
Frequencies are computed in fp32 on the fly (cheap, and never cast to bf16 with the model).

--rotary-interleaved (`apply_rotary_pairs`) rotates the pairs (x0, x1), (x2, x3), ... in
place instead, as Megatron's _rotate_half(rotary_interleaved=True).

Multi-latent attention (model/mla.py) uses YaRN frequencies and its concentration factor
(`yarn_cos_sin`) and DeepSeek's interleaved pair order (`apply_rotary_interleaved`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def rotary_dim(kv_channels: int, rotary_percent: float) -> int:
    """Channels of each head that rotate (even and positive: ModelConfig checks it)."""
    return int(kv_channels * rotary_percent)


# Llama 3.x's RoPE scaling constants (Megatron's RotaryEmbedding._apply_scaling defaults;
# no flag sets them).
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """--use-rope-scaling: wavelengths above the original context / 1 are slowed down by
    `factor`, those below context / 4 kept, and those between blended smoothly (Megatron's
    _apply_scaling, after transformers' llama3 rope init), op for op."""
    old = LLAMA3_ORIGINAL_CONTEXT
    low_wavelen = old / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = old / LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(seq_length: int, rot_dim: int, base: float, *,
                   position_ids_BS: Optional[torch.Tensor] = None,
                   device: Optional[torch.device] = None,
                   rope_scaling_factor: Optional[float] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [S, B or 1, 1, rot_dim] in fp32, broadcastable over [S, B, N, D];
    `rope_scaling_factor`: Llama 3.x's frequency scaling (--use-rope-scaling)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, device=device,
                                            dtype=torch.float32) / rot_dim))
    if rope_scaling_factor is not None:
        inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling_factor)
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


def apply_rotary_pairs(x_SBND: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """--rotary-interleaved: channels (2i, 2i+1) rotate by pair i's angle,
    (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin), output in the input's order. Megatron
    builds the angles [f0, f0, f1, f1, ...] and _rotate_half stacks (-x_odd, x_even); `cos`
    and `sin` here are the rotate-half ones ([f0 .. fn, f0 .. fn]), so their first half
    is repeated pairwise."""
    rot = cos.shape[-1]
    x_rot, x_pass = x_SBND[..., :rot], x_SBND[..., rot:]
    cos = cos[..., :rot // 2].repeat_interleave(2, dim=-1).to(x_SBND.dtype)
    sin = sin[..., :rot // 2].repeat_interleave(2, dim=-1).to(x_SBND.dtype)
    swapped = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
    out = x_rot * cos + swapped * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term (DeepSeek's yarn_get_mscale, Megatron's
    _yarn_get_mscale): 1 without scaling."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration(scale: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor cos and sin are multiplied by (Megatron's _yarn_get_concentration_factor
    with both values given, as its MLA always passes them)."""
    return yarn_get_mscale(scale, mscale) / yarn_get_mscale(scale, mscale_all_dim)


def _yarn_correction_dim(num_rotations: float, dim: int, base: float,
                         max_position: int) -> float:
    return (dim * math.log(max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, scale: float, original_max_position: int,
                  beta_fast: float, beta_slow: float,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """YaRN's per-pair inverse frequencies [dim/2] (fp32): extrapolated (plain RoPE) for the
    fast-rotating pairs, interpolated (/ scale) for the slow ones, a linear ramp between
    (Megatron's YarnRotaryEmbedding, transformers' _compute_yarn_parameters; the
    correction range rounded to integers, their default)."""
    pos = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    extra, inter = 1.0 / pos, 1.0 / (scale * pos)
    low = max(math.floor(_yarn_correction_dim(beta_fast, dim, base, original_max_position)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, dim, base, original_max_position)),
               dim - 1)
    if low == high:
        high += 0.001  # (no singular ramp)
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low)
            / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate
    return inter * (1 - keep) + extra * keep


def yarn_cos_sin(seq_length: int, dim: int, base: float, scale: float,
                 original_max_position: int, beta_fast: float, beta_slow: float,
                 concentration: float, *, position_ids_BS: Optional[torch.Tensor] = None,
                 device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, B or 1, 1, dim] (fp32) of YaRN, times `concentration` (Megatron
    multiplies cos and sin by it, transformers its attention_scaling)."""
    inv_freq = yarn_inv_freq(dim, base, scale, original_max_position, beta_fast, beta_slow,
                             device)
    if position_ids_BS is None:
        pos_S1 = torch.arange(seq_length, device=device, dtype=torch.float32)[:, None]
    else:
        pos_S1 = position_ids_BS.to(device=device, dtype=torch.float32).t()
    freqs = pos_S1[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos() * concentration, emb.sin() * concentration


def apply_rotary_interleaved(x_SBND: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> torch.Tensor:
    """MLA's rotary convention (Megatron's mla_rotary_interleaved, DeepSeek's
    rope_interleave): the rotated channels come in pairs (x0, x1), (x2, x3), ...; they are
    de-interleaved to [x0, x2, ..., x1, x3, ...] and rotated in halves, so the output is in
    the de-interleaved order (queries and keys alike: their dot product is unchanged)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x_SBND[..., :rot], x_SBND[..., rot:]
    x_rot = torch.cat((x_rot[..., 0::2], x_rot[..., 1::2]), dim=-1)
    out = apply_rotary(x_rot, cos, sin)
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)
