"""One grouped GEMM, several backends: y[rows of e] = x[rows of e] @ w[e].

Rows of x are grouped by expert (see permute.py); `tokens_per_expert_E` gives the group
sizes. Backends must agree with the portable loop forward and backward:

  grouped_gemm  CUTLASS kernels of the `grouped_gemm` package (CUDA, bf16), optional
  torch         torch.nn.functional.grouped_mm (CPU fp32/bf16/fp16; CUDA bf16)
  loop          one matmul per expert (reference and fallback)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Optional accelerator: never required, never allowed to break the CPU path.
    import grouped_gemm as _gg
except Exception:  # noqa: BLE001 - any import failure (missing, ABI, CUDA) means "absent"
    _gg = None

BACKENDS = ("auto", "grouped_gemm", "torch", "loop")
_TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available_backends() -> list[str]:
    """Concrete backends usable in this process (loop always is)."""
    out = []
    if _gg is not None and torch.cuda.is_available():
        out.append("grouped_gemm")
    if hasattr(F, "grouped_mm"):
        out.append("torch")
    out.append("loop")
    return out


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous, 16-byte aligned gradient.

    grouped_mm's backward rejects expanded (stride-0) or misaligned gradients, which
    ordinary ops such as .sum() or slicing produce.
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        if grad.data_ptr() % 16 != 0:
            grad = grad.clone()
        return grad


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(
        (s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])


def _torch_supported(x_NK: torch.Tensor, w_EKM: torch.Tensor) -> bool:
    """grouped_mm's constraints: dtype, 16-byte row strides, and bf16 only on CUDA."""
    if not hasattr(F, "grouped_mm") or x_NK.dtype != w_EKM.dtype:
        return False
    if x_NK.is_cuda and x_NK.dtype != torch.bfloat16:
        return False
    if x_NK.dtype not in _TORCH_DTYPES or x_NK.shape[0] == 0:
        return False
    k, m = w_EKM.shape[1], w_EKM.shape[2]
    return (k * x_NK.element_size()) % 16 == 0 and (m * x_NK.element_size()) % 16 == 0


def _grouped_gemm_supported(x_NK: torch.Tensor, w_EKM: torch.Tensor) -> bool:
    return (_gg is not None and x_NK.is_cuda and x_NK.dtype == torch.bfloat16
            and w_EKM.dtype == torch.bfloat16 and x_NK.shape[0] > 0)


def _mm_torch(x_NK: torch.Tensor, w_EKM: torch.Tensor,
              tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    x_NK = x_NK.contiguous()
    if not _aligned(x_NK):
        x_NK = x_NK.clone()
    offs_E = tokens_per_expert_E.cumsum(0).to(device=x_NK.device, dtype=torch.int32)
    return _ContiguousGrad.apply(F.grouped_mm(x_NK, w_EKM, offs=offs_E))


def _mm_grouped_gemm(x_NK: torch.Tensor, w_EKM: torch.Tensor,
                     tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    # The CUTLASS kernels take the group sizes as a CPU int64 tensor.
    batch_sizes_E = tokens_per_expert_E.to(device="cpu", dtype=torch.int64)
    return _gg.ops.gmm(x_NK.contiguous(), w_EKM, batch_sizes_E, trans_b=False)


def _mm_loop(x_NK: torch.Tensor, w_EKM: torch.Tensor,
             tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """Per-expert matmuls (Megatron's SequentialMLP); empty groups cost nothing."""
    sizes = tokens_per_expert_E.tolist()
    out = [x_e @ w_EKM[e] for e, x_e in enumerate(torch.split(x_NK, sizes, dim=0))]
    return torch.cat(out, dim=0)


def resolve_backend(x_NK: torch.Tensor, w_EKM: torch.Tensor, backend: str = "auto") -> str:
    """The concrete backend `grouped_mm` would use for these operands."""
    if backend == "auto":
        if _grouped_gemm_supported(x_NK, w_EKM):
            return "grouped_gemm"
        return "torch" if _torch_supported(x_NK, w_EKM) else "loop"
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped GEMM backend {backend!r}; choose from {BACKENDS}")
    if x_NK.shape[0] == 0:
        return "loop"  # nothing to compute; the fused kernels reject empty operands
    if backend == "grouped_gemm" and not _grouped_gemm_supported(x_NK, w_EKM):
        raise ValueError("grouped_gemm backend needs the grouped_gemm package and bf16 CUDA "
                         f"tensors (got {x_NK.dtype} on {x_NK.device})")
    if backend == "torch" and not _torch_supported(x_NK, w_EKM):
        raise ValueError("torch grouped_mm backend needs fp32/bf16/fp16 (bf16 on CUDA) and "
                         "row sizes that are multiples of 16 bytes; got "
                         f"{x_NK.dtype} x {tuple(w_EKM.shape)} on {x_NK.device}")
    return backend


_IMPLS = {"grouped_gemm": _mm_grouped_gemm, "torch": _mm_torch, "loop": _mm_loop}


def grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor,
               backend: str = "auto") -> torch.Tensor:
    """y_NM where rows of group e are multiplied by w_EKM[e]; differentiable in x and w."""
    if x_NK.dim() != 2 or w_EKM.dim() != 3 or x_NK.shape[1] != w_EKM.shape[1]:
        raise ValueError(f"grouped_mm: bad shapes x {tuple(x_NK.shape)}, w {tuple(w_EKM.shape)}")
    if tokens_per_expert_E.numel() != w_EKM.shape[0]:
        raise ValueError(f"grouped_mm: {tokens_per_expert_E.numel()} group sizes for "
                         f"{w_EKM.shape[0]} weight matrices")
    if tokens_per_expert_E.device.type == "cpu" and int(tokens_per_expert_E.sum()) != len(x_NK):
        raise ValueError(f"grouped_mm: group sizes sum to {int(tokens_per_expert_E.sum())}, "
                         f"x has {len(x_NK)} rows")
    impl = _IMPLS[resolve_backend(x_NK, w_EKM, backend)]
    return impl(x_NK, w_EKM, tokens_per_expert_E)


class _GatherGroupedMM(torch.autograd.Function):
    """y = grouped_mm(x_TH[token_indices_N], w) that saves x_TH, not the gathered copies.

    The [N, H] gathered input (k copies of every token) would otherwise be kept for the
    weight gradient; re-gathering it in backward costs one index_select and saves
    k x H values per token of activation memory.
    """

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, token_indices_N: torch.Tensor, w_EKM: torch.Tensor,
                offs_E: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TH, token_indices_N, w_EKM, offs_E)
        return F.grouped_mm(x_TH.index_select(0, token_indices_N), w_EKM, offs=offs_E)

    @staticmethod
    def backward(ctx, grad_NM: torch.Tensor):
        x_TH, token_indices_N, w_EKM, offs_E = ctx.saved_tensors
        grad_NM = grad_NM.contiguous()
        if not _aligned(grad_NM):
            grad_NM = grad_NM.clone()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_NK = F.grouped_mm(grad_NM, w_EKM.transpose(1, 2), offs=offs_E)
            grad_x = torch.zeros_like(x_TH).index_add_(0, token_indices_N, grad_NK)
        if ctx.needs_input_grad[2]:
            x_NK = x_TH.index_select(0, token_indices_N)
            grad_w = F.grouped_mm(x_NK.t(), grad_NM, offs=offs_E)
        return grad_x, None, grad_w, None


def gather_grouped_mm(x_TK: torch.Tensor, token_indices_N: torch.Tensor, w_EKM: torch.Tensor,
                      tokens_per_expert_E: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """grouped_mm(x_TK[token_indices_N], w_EKM) without keeping the gathered rows for
    backward when the torch backend runs; other backends gather, then multiply."""
    if backend in ("auto", "torch") and len(token_indices_N) > 0 and \
            resolve_backend(x_TK, w_EKM, backend) == "torch":
        x_TK = x_TK.contiguous()
        if not _aligned(x_TK):
            x_TK = x_TK.clone()
        offs_E = tokens_per_expert_E.cumsum(0).to(device=x_TK.device, dtype=torch.int32)
        return _GatherGroupedMM.apply(x_TK, token_indices_N, w_EKM, offs_E)
    return grouped_mm(x_TK.index_select(0, token_indices_N), w_EKM, tokens_per_expert_E,
                      backend)
