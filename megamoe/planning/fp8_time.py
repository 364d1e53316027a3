"""The FP8 share of the planner's GEMM time (planner.step_time with FP8 on).

With --fp8-format the GEMMs the FP8 policy converts (model/fp8/policy.py: every linear
inside the decoder and MTP layers and the routed experts, and with --fp8-output-proj the
output layer's GEMMs for the LM head and every MTP head) run at the GPU's FP8 peak; the
rest stays at the bf16 peak: the attention core, the output layer (without
--fp8-output-proj), the router and the shared-expert gate (raw parameters, not converted
linears), and every GEMM of a decoder layer that --first-last-layers-bf16 keeps in bf16
(policy.high_precision_layer). With --no-fp8-wgrad the weight-gradient GEMMs stay in bf16
(4 of the 6 FLOPs per weight are FP8). Recompute's replayed forward counts the same way.

Both peaks are reached at the same fraction (the planner's gemm_efficiency): no FP8
measurement exists yet to fit a separate one (docs/planner-calibration.md).

Left out: quantisation's memory traffic. Each quantised operand is read in bf16 and
written in FP8 (about 3 bytes per value, plus its scales) before its GEMM, but the
planner has no HBM bandwidth to price it; it is small next to the GEMMs of large
hidden sizes (a [T, K] operand's traffic against its 2 T K N FLOPs) and large for thin
GEMMs, so the FP8 step time is a lower bound there.
"""

from __future__ import annotations

from typing import Optional

from megamoe.config import ConfigError, Fp8Config, ModelConfig, RecomputeConfig
from megamoe.model.flops import (
    fp8_flops_per_token,
    output_matmul_parameters,
    recompute_flops_per_token,
)
from megamoe.model.fp8.policy import high_precision_layer
from megamoe.planning.gpu_peaks import no_fp8_message


def fp8_on(fp8: Optional[Fp8Config]) -> bool:
    return fp8 is not None and fp8.enabled


def fp8_gemm_flops_per_token(model: ModelConfig, recompute: RecomputeConfig,
                             fp8: Optional[Fp8Config]) -> float:
    """FLOPs per trained token that run in FP8 (model FLOPs plus recompute's replay);
    0 with FP8 off."""
    if not fp8_on(fp8):
        return 0.0

    def in_fp8(i: int) -> bool:  # MTP layers (i >= num_layers) always run in FP8
        return not high_precision_layer(fp8, i, model.num_layers)
    # --fp8-output-proj: the output layer's forward, dgrad and wgrad (MXFP8: FP8 wgrad;
    # no recompute replays it), for the LM head and each MTP depth's head
    output = 6 * output_matmul_parameters(model) if fp8.output_proj else 0
    return (fp8_flops_per_token(model, in_fp8, fp8.fp8_wgrad) + output
            + recompute_flops_per_token(model, recompute, in_fp8))


def check_fp8_peak(peak_fp8_tflops: Optional[float], gpu: str) -> float:
    """The FP8 peak to price FP8 GEMMs at; one line when the GPU has none."""
    if peak_fp8_tflops is None:
        raise ConfigError(no_fp8_message(gpu))
    return peak_fp8_tflops
