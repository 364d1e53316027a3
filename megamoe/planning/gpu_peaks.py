"""Dense tensor-core peaks of the GPUs the planner prices: bf16 and FP8, by GPU name.

The step-time model divides GEMM FLOPs by a peak x efficiency (planner.step_time); with
FP8 on, the GEMMs the FP8 policy converts count at the FP8 peak instead (fp8_time.py).
The figures are NVIDIA's datasheet numbers halved: the datasheets quote them "with
sparsity" (2:4 structured sparsity doubles the rate), training GEMMs are dense. A GPU
without FP8 tensor cores has fp8 None, and FP8 planning on it is refused with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): BF16 1,979 and FP8 3,958
# teraFLOPS "with sparsity", i.e. 989 and 1,979 dense. The H200 datasheet (H200 SXM)
# quotes the same tensor-core rates.
H100_SXM_BF16_TFLOPS = 989.0
H100_SXM_FP8_TFLOPS = 1979.0


@dataclass(frozen=True)
class GpuPeaks:
    """Dense TFLOP/s of one GPU; `fp8_tflops` None: no FP8 tensor cores."""

    bf16_tflops: float
    fp8_tflops: Optional[float]


GPU_PEAKS = {
    "H100": GpuPeaks(H100_SXM_BF16_TFLOPS, H100_SXM_FP8_TFLOPS),  # SXM
    "H200": GpuPeaks(H100_SXM_BF16_TFLOPS, H100_SXM_FP8_TFLOPS),  # SXM
    "H100-PCIe": GpuPeaks(756.0, 1513.0),  # datasheet: 1,513 / 3,026 with sparsity
    "L40S": GpuPeaks(362.0, 733.0),  # datasheet: 733 / 1,466 with sparsity
    "A100": GpuPeaks(312.0, None),  # Ampere: bf16 624 with sparsity; no FP8 tensor cores
}


def no_fp8_message(gpu: str) -> str:
    """The one line FP8 planning says on a GPU without FP8 tensor cores."""
    return (f"FP8 planning: {gpu} has no FP8 tensor cores (no FP8 peak in the GPU table): "
            f"plan without --fp8-format, or give --peak-fp8-tflops")
