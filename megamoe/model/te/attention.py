"""Core attention on TE's DotProductAttention (Megatron's TEDotProductAttention).

SelfAttention hands the engine q [B, N, S, D], k and v [B, G, S, D] (its SDPA layout;
MLA: G = N, and v's head dim Dv its own); TE takes them as "sbhd" ([S, B, heads, D]: the
same tensors permuted, no copy) with `num_gqa_groups` = G, and returns [S, B, N * Dv],
which goes back to [B, N, S, Dv] as a view. The mask is TE's "causal" (the query at i sees
keys 0..i), the softmax scale TE's default 1/sqrt(D), as SDPA's (MLA: its own scale);
dropout is `--attention-dropout`, drawn under the caller's RNG context (this rank's heads'
stream, as the local path).

--attention-backend keeps Megatron's meaning under TE: Megatron-Core sets TE's backend
switches NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN from it
(LanguageModule._set_attention_backend, megatron/core/models/common/language_module/
language_module.py): the chosen backend's switch 1 and the others 0, all three 1 for
`auto` (TE then picks), and a switch already set in the environment to another value is an
error. `backend_environment` and `environment_conflict` reproduce that.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch

from megamoe.model.te.engine import Engine
from megamoe.model.te.loader import TransformerEngine

_BACKEND_SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
_BACKEND_ON = {"flash": "NVTE_FLASH_ATTN", "fused": "NVTE_FUSED_ATTN",
               "unfused": "NVTE_UNFUSED_ATTN"}


def backend_environment(backend: str, use_flash_attn: bool = False) -> dict[str, str]:
    """TE's attention-backend switches for --attention-backend (and --use-flash-attn,
    which asks for flash attention)."""
    if use_flash_attn:
        backend = "flash"
    on = _BACKEND_ON.get(backend)
    return {name: "1" if on is None or name == on else "0" for name in _BACKEND_SWITCHES}


def environment_conflict(backend: str, use_flash_attn: bool = False,
                         environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The line saying which switch the environment already sets otherwise (None: none)."""
    environ = os.environ if environ is None else environ
    for name, value in backend_environment(backend, use_flash_attn).items():
        if environ.get(name) not in (None, value):
            return (f"{name}={environ[name]} in the environment, but --attention-backend "
                    f"{'flash' if use_flash_attn else backend} sets it to {value}: unset "
                    f"{', '.join(_BACKEND_SWITCHES)} and choose with --attention-backend")
    return None


def set_backend_environment(backend: str, use_flash_attn: bool = False) -> None:
    """Set TE's switches in this process before any DotProductAttention is built (TE reads
    them when it picks a backend); ValueError on a conflicting preset switch."""
    conflict = environment_conflict(backend, use_flash_attn)
    if conflict:
        raise ValueError(conflict)
    os.environ.update(backend_environment(backend, use_flash_attn))


class TeCoreAttention(Engine):
    """The core attention of SelfAttention or MLASelfAttention (`owner`) on
    DotProductAttention. MLA (Megatron's MultiLatentAttention builds its
    TEDotProductAttention so) gives `v_head_dim` (TE's kv_channels=(k, v): values narrower
    than queries and keys) and its own `softmax_scale`; None keeps TE's 1/sqrt(head_dim)."""

    def __init__(self, te: TransformerEngine, owner, *, num_heads: int, num_groups: int,
                 head_dim: int, layer_number: int, v_head_dim: Optional[int] = None,
                 softmax_scale: Optional[float] = None) -> None:
        kv_channels = head_dim if v_head_dim is None else (head_dim, v_head_dim)
        scale = {} if softmax_scale is None else {"softmax_scale": softmax_scale}
        module = te.pytorch.DotProductAttention(
            num_heads, kv_channels, num_gqa_groups=num_groups,
            attention_dropout=owner.attention_dropout, qkv_format="sbhd",
            attn_mask_type="causal", layer_number=layer_number, **scale)
        super().__init__(module, owner)

    def __call__(self, q_BNSD: torch.Tensor, k_BGSD: torch.Tensor,
                 v_BGSD: torch.Tensor) -> torch.Tensor:
        self.sync_mode()
        b, n, s, _ = q_BNSD.shape
        q_SBND, k_SBGD, v_SBGD = (t.permute(2, 0, 1, 3) for t in (q_BNSD, k_BGSD, v_BGSD))
        o_SBX = self.module(q_SBND, k_SBGD, v_SBGD)
        return o_SBX.view(s, b, n, v_BGSD.shape[-1]).permute(1, 2, 0, 3)
