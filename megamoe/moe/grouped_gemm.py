"""One grouped GEMM, several backends: y[rows of e] = x[rows of e] @ w[e].

Rows of x are grouped by expert (see permute.py); the group sizes come as a plain
tokens_per_expert_E tensor or as the `GroupSizes` of one call of the experts. Backends
must agree with the portable loop forward and backward:

  grouped_gemm  CUTLASS kernels of the `grouped_gemm` package (CUDA, bf16), optional
  torch         torch's grouped GEMM (CPU fp32/bf16/fp16; CUDA bf16): the public
                torch.nn.functional.grouped_mm (torch >= 2.10), or on older torch (NGC
                images) the private torch._grouped_mm it grew from (2.8: CUDA sm90 only;
                2.9: also CPU). One backend name for both; `TORCH_GROUPED_MM` says which
                function it calls.
  loop          one matmul per expert (reference and fallback)

Host synchronisation. "torch" takes the group sizes as offsets on the device: no sync (on
CUDA before sm90, torch's own fallback kernel copies them to the host). "grouped_gemm"
takes them as an int64 CPU tensor and "loop" as a list: one device->host copy, which
`GroupSizes` makes at most once per call of the experts, shared by fc1, fc2 and their
backward (the package's autograd saves the CPU tensor it was given).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

try:  # Optional accelerator: never required, never allowed to break the CPU path.
    import grouped_gemm as _gg
except Exception:  # noqa: BLE001 - any import failure (missing, ABI, CUDA) means "absent"
    _gg = None

BACKENDS = ("auto", "grouped_gemm", "torch", "loop")
_TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PRIVATE = "torch._grouped_mm"


def _torch_grouped_mm() -> tuple[Optional[Callable], str]:
    """The function behind the "torch" backend and its name (None, "" without one)."""
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm, "torch.nn.functional.grouped_mm"
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm, _PRIVATE
    return None, ""


_TORCH_MM, TORCH_GROUPED_MM = _torch_grouped_mm()


def _private_cpu_kernel() -> bool:
    """torch._grouped_mm has a CPU kernel from torch 2.9 (2.8 raises NotImplementedError)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def available_backends() -> list[str]:
    """Concrete backends usable in this process (loop always is)."""
    out = []
    if _gg is not None and torch.cuda.is_available():
        out.append("grouped_gemm")
    if _TORCH_MM is not None:
        out.append("torch")
    out.append("loop")
    return out


class GroupSizes:
    """Rows per expert for one call of the experts: `device_E` (where the dispatcher made
    them) and the host copy a backend may need: given by a dispatcher that has the sizes
    on the host anyway (all-to-all), else made on the first request (one device->host
    sync per call, whatever backends fc1 and fc2 use) and then shared; plus the int32
    offsets torch's grouped GEMM takes."""

    def __init__(self, tokens_per_expert_E: torch.Tensor,
                 host: Optional[list[int]] = None) -> None:
        self.device_E = tokens_per_expert_E
        self._host = None if host is None else list(host)
        self._host_E: Optional[torch.Tensor] = None
        self._offsets: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.device_E.numel()

    def known_on_host(self) -> bool:
        return self._host is not None

    def host_list(self) -> list[int]:
        if self._host is None:
            self._host = self.device_E.tolist()  # the one device->host copy
        return self._host

    def host_tensor(self) -> torch.Tensor:
        """int64 on the CPU, as the grouped_gemm package takes its batch sizes."""
        if self._host_E is None:
            # Host metadata on purpose: the CUTLASS kernels read the sizes on the CPU.
            self._host_E = torch.tensor(self.host_list(), dtype=torch.int64, device="cpu")
        return self._host_E

    def offsets(self, device: torch.device) -> torch.Tensor:
        """Cumulative row ends (int32) on `device`, computed there: no sync."""
        if self._offsets is None:
            self._offsets = self.device_E.cumsum(0).to(device=device, dtype=torch.int32)
        return self._offsets


Sizes = Union[torch.Tensor, GroupSizes]


def as_group_sizes(sizes: Sizes) -> GroupSizes:
    """A GroupSizes for rows-per-expert given either way."""
    return sizes if isinstance(sizes, GroupSizes) else GroupSizes(sizes)


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
    """torch's grouped GEMM constraints: dtype, 16-byte row strides, bf16 only on CUDA; the
    private torch._grouped_mm only on sm90 (torch 2.8's gate) or a 2.9 CPU."""
    if _TORCH_MM is None or x_NK.dtype != w_EKM.dtype or x_NK.shape[0] == 0:
        return False
    private = TORCH_GROUPED_MM == _PRIVATE
    if x_NK.is_cuda:
        if x_NK.dtype != torch.bfloat16:
            return False
        if private and torch.cuda.get_device_capability(x_NK.device)[0] != 9:
            return False
    elif x_NK.dtype not in _TORCH_DTYPES:
        return False
    elif private and not (x_NK.device.type == "cpu" and _private_cpu_kernel()):
        return False
    k, m = w_EKM.shape[1], w_EKM.shape[2]
    return (k * x_NK.element_size()) % 16 == 0 and (m * x_NK.element_size()) % 16 == 0


def _cuda_operands(x_NK: torch.Tensor, w_EKM: torch.Tensor) -> bool:
    """The grouped_gemm package runs on CUDA tensors only (its contract test fakes this)."""
    return x_NK.is_cuda and w_EKM.is_cuda


def _grouped_gemm_supported(x_NK: torch.Tensor, w_EKM: torch.Tensor) -> bool:
    return (_gg is not None and _cuda_operands(x_NK, w_EKM) and x_NK.dtype == torch.bfloat16
            and w_EKM.dtype == torch.bfloat16 and x_NK.shape[0] > 0)


def _mm_torch(x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes: GroupSizes) -> torch.Tensor:
    x_NK = x_NK.contiguous()
    if not _aligned(x_NK):
        x_NK = x_NK.clone()
    return _ContiguousGrad.apply(_TORCH_MM(x_NK, w_EKM, offs=sizes.offsets(x_NK.device)))


def _mm_grouped_gemm(x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes: GroupSizes
                     ) -> torch.Tensor:
    """grouped_gemm.ops.gmm(a [N, K] bf16 contiguous, b [E, K, M] bf16 contiguous,
    batch_sizes [E] int64 on the CPU, trans_b=False) -> [N, M]; its autograd saves the
    batch sizes and reuses them in backward."""
    return _gg.ops.gmm(x_NK.contiguous(), w_EKM.contiguous(), sizes.host_tensor(),
                       trans_b=False)


def _mm_loop(x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes: GroupSizes) -> torch.Tensor:
    """Per-expert matmuls (Megatron's SequentialMLP); empty groups cost nothing."""
    split = sizes.host_list() if x_NK.shape[0] else [0] * len(sizes)  # no rows: no sync
    out = [x_e @ w_EKM[e] for e, x_e in enumerate(torch.split(x_NK, split, dim=0))]
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


# Under --compile the grouped GEMMs stay eager calls between the compiled graphs: torch's
# fake (tracing) kernel of _grouped_mm accepts bf16 only, and the backends' checks read
# sizes and pointers. The kernel that runs is the same; what surrounds it is compiled.
@torch.compiler.disable
def grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: Sizes,
               backend: str = "auto") -> torch.Tensor:
    """y_NM where rows of group e are multiplied by w_EKM[e]; differentiable in x and w.

    The group sizes are checked against x's rows when they are on the host anyway (a CPU
    tensor, or a GroupSizes whose host copy exists); checking device sizes would cost a
    sync."""
    if x_NK.dim() != 2 or w_EKM.dim() != 3 or x_NK.shape[1] != w_EKM.shape[1]:
        raise ValueError(f"grouped_mm: bad shapes x {tuple(x_NK.shape)}, w {tuple(w_EKM.shape)}")
    sizes = as_group_sizes(tokens_per_expert_E)
    if len(sizes) != w_EKM.shape[0]:
        raise ValueError(f"grouped_mm: {len(sizes)} group sizes for "
                         f"{w_EKM.shape[0]} weight matrices")
    if sizes.known_on_host() or (sizes.device_E.device.type == "cpu"
                                 and not isinstance(tokens_per_expert_E, GroupSizes)):
        total = sum(sizes.host_list())
        if total != len(x_NK):
            raise ValueError(f"grouped_mm: group sizes sum to {total}, x has {len(x_NK)} rows")
    impl = _IMPLS[resolve_backend(x_NK, w_EKM, backend)]
    return impl(x_NK, w_EKM, sizes)


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
        return _TORCH_MM(x_TH.index_select(0, token_indices_N), w_EKM, offs=offs_E)

    @staticmethod
    def backward(ctx, grad_NM: torch.Tensor):
        x_TH, token_indices_N, w_EKM, offs_E = ctx.saved_tensors
        grad_NM = grad_NM.contiguous()
        if not _aligned(grad_NM):
            grad_NM = grad_NM.clone()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_NK = _TORCH_MM(grad_NM, w_EKM.transpose(1, 2), offs=offs_E)
            grad_x = torch.zeros_like(x_TH).index_add_(0, token_indices_N, grad_NK)
        if ctx.needs_input_grad[2]:
            x_NK = x_TH.index_select(0, token_indices_N)
            grad_w = _TORCH_MM(x_NK.t(), grad_NM, offs=offs_E)
        return grad_x, None, grad_w, None


@torch.compiler.disable
def gather_grouped_mm(x_TK: torch.Tensor, token_indices_N: torch.Tensor, w_EKM: torch.Tensor,
                      tokens_per_expert_E: Sizes, backend: str = "auto") -> torch.Tensor:
    """grouped_mm(x_TK[token_indices_N], w_EKM) without keeping the gathered rows for
    backward when the torch backend runs; other backends gather, then multiply."""
    sizes = as_group_sizes(tokens_per_expert_E)
    if backend in ("auto", "torch") and len(token_indices_N) > 0 and \
            resolve_backend(x_TK, w_EKM, backend) == "torch":
        x_TK = x_TK.contiguous()
        if not _aligned(x_TK):
            x_TK = x_TK.clone()
        return _GatherGroupedMM.apply(x_TK, token_indices_N, w_EKM, sizes.offsets(x_TK.device))
    return grouped_mm(x_TK.index_select(0, token_indices_N), w_EKM, sizes, backend)
