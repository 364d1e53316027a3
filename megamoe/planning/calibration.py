"""The step-time model's efficiency constants, fitted to published Megatron-Core throughput.

The planner's step time (planner.step_time) divides GEMM FLOPs by peak x `gemm_efficiency`
and collective volumes by link bandwidth x `comm_efficiency`. Both were guesses (0.6 and
0.7) that put Qwen3-30B-A3B at 81% of H100 peak, far above anything Megatron-Core
publishes. tools/calibrate_planner.py fits them on half of the published bf16 H100 rows
in tools/planner_calibration.json (the other half is held out to measure the fit) and
docs/planner-calibration.md reports the result; tests/tools/test_calibrate_planner.py
fails when these defaults drift from what the script fits.

Only H100 rows are comparable today (the published B200 / GB200 MoE rows are FP8 or use
CUDA graphs), so these are the H100 defaults; other GPUs keep them until rows exist, and
--gemm-efficiency / --comm-efficiency override them.
"""

from __future__ import annotations

# Fitted by tools/calibrate_planner.py on tools/planner_calibration.json (H100, bf16).
# comm_efficiency sits at the grid's bound (1.0): the calibration rows ask for less exposed
# communication than the model counts (it ignores Megatron's overlap of the gradient
# reduce and of the all-to-all), and a collective cannot beat its link.
H100_GEMM_EFFICIENCY = 0.64
H100_COMM_EFFICIENCY = 1.0
