"""What FP8 adds to one rank's memory in the planner and --dry-run: delayed scaling's
amax histories and scales (fp32, per GEMM operand: input, weight, output gradient; one
per local expert for the experts' GEMMs). Tensorwise scaling keeps no state.

Not modelled yet (docs/fp8.md): the FP8 copies autograd keeps instead of the
high-precision inputs (smaller activations) and the per-step FP8 weight copies.
"""

from __future__ import annotations

from torch import nn

from megamoe.config import RunConfig
from megamoe.model.fp8.policy import fp8_gemm_modules
from megamoe.moe.experts import GroupedExperts


def fp8_report(run: RunConfig, model: nn.Module | None) -> dict | None:
    """{"format", "recipe", "gemms", "amax_history_bytes_per_rank"} of the largest
    pipeline stage, from the (meta) single-process model; None without FP8."""
    f = run.fp8
    if not f.enabled:
        return None
    par = run.parallel
    ep = par.expert_model_parallel_size
    # Transformer Engine keeps 5 states per GEMM: 3 forward (input, weight, output), 2
    # backward (its TransformerEngineBaseModule: num_gemms * 3 and * 2 quantizer states)
    per_gemm = 5 if run.model.transformer_impl == "transformer_engine" else 3
    tensors = 0
    gemms = 0
    for _, m in fp8_gemm_modules(model) if model is not None else []:
        if isinstance(m, GroupedExperts):
            gemms += 2
            tensors += 2 * per_gemm * max(1, m.num_local_experts // ep)
        else:
            gemms += 1
            tensors += per_gemm
    num_layers = run.model.num_layers
    stage = max(sum(hi - lo for lo, hi in chunks)
                for chunks in par.layer_ranges(num_layers))
    per_rank = tensors * stage / num_layers  # GEMMs per layer are the same in every layer
    state = (f.amax_history_len + 1) * 4 if f.recipe == "delayed" else 0
    return {"format": f.format, "recipe": f.recipe, "gemms": gemms,
            "amax_history_bytes_per_rank": int(per_rank * state)}
