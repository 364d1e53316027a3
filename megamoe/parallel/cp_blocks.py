"""The math of one context-parallel attention block: this rank's queries against one K/V
block of the ring (parallel/context_parallel.py), forward (a partial output and its
log-sum-exp, merged online by the caller) and the recomputing backward (dq, dk, dv of the
block from the final output and log-sum-exp).

Two ways to compute a block:
- kernels (the default where they apply): PyTorch's SDPA ops that return the log-sum-exp,
  so the [Sq, Sk] scores live only in tiles inside the kernel and a block's transient
  memory grows linearly with its length:
  `cuda_flash`: `aten._scaled_dot_product_flash_attention` (CUDA, bf16/fp16, equal q/k/v
  head dims; lse [B, N, Sq] fp32, natural log), backward
  `_scaled_dot_product_flash_attention_backward`;
  `cuda_efficient`: `aten._scaled_dot_product_efficient_attention` with
  compute_log_sumexp (CUDA fp32, and MLA's V head dim != K's; lse [B, N, Sq rounded up to
  32] fp32, natural log; ROCm leaves it unpadded), backward
  `_scaled_dot_product_efficient_attention_backward`, which gets the lse padded back;
  `cpu_flash`: `aten._scaled_dot_product_flash_attention_for_cpu` (fp64/fp32/bf16/fp16;
  lse [B, N, Sq] natural log in the accumulation dtype, stored with [B, Sq, N] strides),
  backward `_scaled_dot_product_flash_attention_for_cpu_backward`; it needs equal head
  dims, so MLA's q/k and v are zero-padded to the wider one (exact: zero channels add
  nothing to q.k and give zero output channels, which are cut off).
  All three give the natural-log lse (as PyTorch's own ring attention,
  torch/distributed/tensor/experimental/_context_parallel/_attention.py, merges them).
  The CUDA choice is PyTorch's own (`can_use_flash_attention` /
  `can_use_efficient_attention`: dtype, head dims, architecture, the user's
  `torch.backends.cuda.enable_*_sdp` switches, which --attention-backend sets through
  `sdpa_kernel` around the call: unfused/local allow only MATH, so the blocks are explicit;
  on the CPU the flash switch governs `cpu_flash`, as it governs SDPA's). K/V heads are
  expanded to the query heads (GQA) and dk/dv summed back over each group,
  as the explicit path does.
- explicit (`explicit_forward` / `explicit_backward`): the scores of the block formed in
  fp32 (or the input's wider dtype) with an arbitrary boolean mask and an optional
  dropout keep-mask. Used where a block needs what the kernels cannot take: document masks
  (`ids_BS`: the mask is per token pair) and attention dropout (the keep-mask must be
  drawn per block and redrawn in backward, parallel/context_parallel.py's `_Dropout`),
  on devices without a kernel, and under `explicit_blocks()` (benchmarks, tests).

A kernel block is causal (the diagonal block) or fully visible: the load-balanced layout
decides which rows and columns of the block take part (cp_layout.block_plan), so the
kernels never need a mask. The backward op of each kernel recomputes the block's
probabilities as exp(s - lse) with the *final* lse, and delta = rowsum(dout * out) with
the final output, so each block's dq/dk/dv is exact (FlashAttention-2's identity).
Rounding: in bf16/fp16 a kernel returns each block's output and dq in the model dtype
(merged and summed in fp32 after), where the explicit blocks kept them in fp32: one more
model-dtype rounding per block, as Transformer Engine's and PyTorch's ring attention; in
fp32/fp64 the two paths agree to rounding (tests/parallel/test_cp_blocks.py, 1e-12 fp64).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

_aten = torch.ops.aten
_FORCE_EXPLICIT = [False]


@contextlib.contextmanager
def explicit_blocks() -> Iterator[None]:
    """Compute every block explicitly while active (the kernels' reference; benchmarks)."""
    before = _FORCE_EXPLICIT[0]
    _FORCE_EXPLICIT[0] = True
    try:
        yield
    finally:
        _FORCE_EXPLICIT[0] = before


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or the input's when wider (fp64 tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def expand_groups(t_BGSD: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // t_BGSD.shape[1]
    return t_BGSD if rep == 1 else t_BGSD.repeat_interleave(rep, dim=1)


def _sum_groups(t_BNSD: torch.Tensor, groups: int) -> torch.Tensor:
    heads = t_BNSD.shape[1]
    return t_BNSD if heads == groups else t_BNSD.unflatten(1, (groups, heads // groups)).sum(2)


def choose_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  needs_mask: bool) -> Optional[str]:
    """The kernel for this call's blocks (None: explicit). Decided once per call from
    metadata only (no host sync); `needs_mask`: document ids or dropout are in play."""
    if needs_mask or _FORCE_EXPLICIT[0]:
        return None
    if q.device.type == "cpu":  # SDPA's CPU flash kernel answers to the flash switch
        ok = q.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)
        return "cpu_flash" if ok and torch.backends.cuda.flash_sdp_enabled() else None
    if q.device.type != "cuda":
        return None
    shape = (q.shape[0], q.shape[1], k.shape[2])  # the kernels see expanded K/V heads
    k_e, v_e = k[:, :1].expand(*shape, k.shape[-1]), v[:, :1].expand(*shape, v.shape[-1])
    params = SDPAParams(q, k_e, v_e, None, 0.0, True, False)
    if can_use_flash_attention(params, False):
        return "cuda_flash"
    if can_use_efficient_attention(params, False):
        return "cuda_efficient"
    return None


def _efficient_lse_width(sq: int) -> int:
    """Width of the efficient op's lse: Sq rounded up to 32 (CUDA), Sq (ROCm)."""
    return sq if torch.version.hip else -(-sq // 32) * 32


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def kernel_forward(kernel: str, q, k, v, causal: bool, scale: float):
    """(out [B, N, Sq, V], lse [B, N, Sq]) of one block in the accumulation dtype, lse
    contiguous; k/v [B, G, Sk, .] (expanded here)."""
    acc = acc_dtype(q)
    k, v = expand_groups(k, q.shape[1]).contiguous(), expand_groups(v, q.shape[1]).contiguous()
    if kernel == "cpu_flash":
        d = max(q.shape[-1], v.shape[-1])
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            _pad_last(q, d), _pad_last(k, d), _pad_last(v, d), 0.0, causal, scale=scale)
        out = out[..., :v.shape[-1]]
    elif kernel == "cuda_flash":
        out, lse = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)[:2]
    elif kernel == "cuda_efficient":
        out, lse = _aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        lse = lse[..., :q.shape[2]]
    else:
        raise ValueError(f"unknown attention block kernel {kernel!r}")
    return out.to(acc), lse.to(acc).contiguous()


def kernel_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq [B, N, Sq, D] in q's dtype, dk, dv [B, G, Sk, .] in the accumulation dtype) of
    one block; `out` (q's dtype) and `lse` are the final ones over the whole sequence."""
    acc, groups, heads = acc_dtype(q), k.shape[1], q.shape[1]
    ke, ve = expand_groups(k, heads).contiguous(), expand_groups(v, heads).contiguous()
    lse = lse.to(torch.float32) if kernel != "cpu_flash" else lse.to(acc)
    if kernel == "cpu_flash":
        d = max(q.shape[-1], v.shape[-1])
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _pad_last(dout, d), _pad_last(q, d), _pad_last(ke, d), _pad_last(ve, d),
            _pad_last(out, d), lse.contiguous(), 0.0, causal, scale=scale)
        dq, dk, dv = dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]
    elif kernel == "cuda_flash":
        none = q.new_empty(0, dtype=torch.int64)  # philox seed/offset: unused without dropout
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse.contiguous(), None, None, q.shape[2], ke.shape[2],
            0.0, causal, none, none, scale=scale)
    elif kernel == "cuda_efficient":
        none = q.new_empty(0, dtype=torch.int64)
        lse = F.pad(lse, (0, _efficient_lse_width(q.shape[2]) - q.shape[2])).contiguous()
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, None, out, lse, none, none, 0.0, [True, True, True, False],
            causal, scale=scale)
    else:
        raise ValueError(f"unknown attention block kernel {kernel!r}")
    return dq, _sum_groups(dk.to(acc), groups), _sum_groups(dv.to(acc), groups)


def explicit_forward(q, k, v, mask, scale, keep=None):
    """(out [B, N, Sq, D], lse [B, N, Sq]) in the accumulation dtype of q against one K/V
    block with a boolean mask; rows with no visible key get out 0 and lse -inf. `keep`:
    the block's dropout keep-mask (scaled), applied to the probabilities, not to the
    log-sum-exp."""
    acc = acc_dtype(q)
    k, v = expand_groups(k, q.shape[1]).to(acc), expand_groups(v, q.shape[1]).to(acc)
    s = torch.matmul(q.to(acc), k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(acc).min))
    return torch.matmul(p if keep is None else p * keep, v), lse


def explicit_backward(q, k, v, lse, dout, delta, mask, scale, keep=None):
    """(dq, dk, dv) of one block, from the final lse and delta = rowsum(dout * out);
    `keep`: the block's forward dropout keep-mask."""
    heads, groups, acc = q.shape[1], k.shape[1], acc_dtype(q)
    ke, ve = expand_groups(k, heads).to(acc), expand_groups(v, heads).to(acc)
    s = torch.matmul(q.to(acc), ke.transpose(-1, -2)) * scale
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
    p = torch.exp(s - safe).masked_fill(~mask, 0.0)
    dp = torch.matmul(dout, ve.transpose(-1, -2))
    if keep is not None:
        dv, dp = torch.matmul((p * keep).transpose(-1, -2), dout), dp * keep
    else:
        dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)
