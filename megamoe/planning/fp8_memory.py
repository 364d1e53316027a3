"""What FP8 adds to one rank's memory in the planner and --dry-run:

  amax histories  delayed scaling's histories and scales (fp32, per GEMM operand: input,
                  weight, output gradient; one per local expert for the experts' GEMMs);
                  tensor-wise and the block recipes keep no state.
  FP8 copies      what the FP8 GEMMs' autograd keeps for backward per micro-batch
                  (model/fp8/linear.py, grouped.py, block_linear.py): each GEMM's input in
                  FP8 (1 byte per value) and its weight in FP8 (the transposed / columnwise
                  copy under the block recipes), plus their scales (fp32: one per tensor,
                  per 1x128 tile or 128x128 block (blockwise), per 1x32 tile (mxfp8, kept
                  as fp32 by the reference), per row (rowwise)), times the micro-batches the
                  stage holds in 1F1B (PP - rank; interleaved as memory.activation_bytes).

The FP8 copies are added to the activation count, and the high-precision inputs the
activation model counts (planning/activations.py) are not removed: most of them stay alive
anyway (a norm keeps its output, SwiGLU its input), so the sum is an upper bound. Routed
tokens are counted balanced over the experts (topk copies per token); MTP layers' GEMMs
are not counted; decoder layers --first-last-layers-bf16 keeps in bf16 keep no FP8 copies.

--fp8-param-gather: the GEMMs keep the optimizer's FP8 weights, so no weight copies; those
weights take 1 byte per value instead of the model dtype's (`fp8_primary_values`, applied
by dry_run.py and the planner), and in an fp32 model they get an fp32 main slice.

With --fp8-output-proj the last pipeline stage also keeps the output layer's copies, once
per head (the LM head and each MTP depth's: each call quantises its own): the full
sequence's hidden states (the head gathers them under SP) and this rank's real-vocabulary
rows of the weight (the most of any TP rank), `output_copy_bytes`.
"""

from __future__ import annotations

from torch import nn

from megamoe.config import RunConfig
from megamoe.model.fp8.policy import fp8_gemm_modules
from megamoe.moe.experts import GroupedExperts
from megamoe.parallel.tensor_parallel import RowParallelLinear

FP32 = 4


def scale_bytes_per_value(recipe: str, k: int, weight: bool) -> float:
    """fp32 scale bytes per quantised value of an operand whose contraction dim is k."""
    if recipe == "blockwise":
        return FP32 / (128 * 128 if weight else 128)
    if recipe == "mxfp8":
        return FP32 / 32
    if recipe == "rowwise":
        return FP32 / k
    return 0.0  # one scale per tensor


def _gemm_shapes(m: nn.Module, tp: int, ep: int, etp: int, topk: int) -> list[tuple]:
    """(input values per token, weight values, contraction dim) on one rank of one FP8
    GEMM module, from the single-process (meta) model's shapes."""
    if isinstance(m, GroupedExperts):
        out = []
        for w in (m.fc1_weight, m.fc2_weight):  # [E, K, M]; ETP splits f
            e, k, n = w.shape
            fc1 = w is m.fc1_weight
            k_local = k if fc1 else k // etp
            out.append((topk * k_local, e // ep * k_local * (n // etp if fc1 else n), k_local))
        return out
    n, k = m.weight.shape
    k_local = k // tp if isinstance(m, RowParallelLinear) else k
    return [(k_local, n * k // tp, k_local)]


def _per_layer(run: RunConfig, model: nn.Module, with_scales: bool
               ) -> dict[int, tuple[float, float, float]]:
    """Decoder layer index -> (FP8 copy bytes per token, per micro-batch fixed bytes, FP8
    weight values). Under --fp8-param-gather the weights are not copied (the GEMMs keep
    the optimizer's FP8 bytes): no fixed bytes."""
    copies_weights = not run.fp8.param_gather
    f, par, m = run.fp8, run.parallel, run.model
    tp, ep = par.tensor_model_parallel_size, par.expert_model_parallel_size
    etp = par.expert_tensor_parallel_size or tp
    topk = m.moe.topk if m.moe.num_experts else 1
    out: dict[int, tuple[float, float]] = {}
    for name, mod in fp8_gemm_modules(model, f, m.num_layers):  # bf16-kept layers: none
        parts = name.split(".")
        if parts[:2] != ["decoder", "layers"]:
            continue  # MTP layers: not counted (module doc)
        i = int(parts[2])
        per_token, fixed, held = out.get(i, (0.0, 0.0, 0.0))
        for values, weights, k in _gemm_shapes(mod, tp, ep, etp, topk):
            scales = with_scales * scale_bytes_per_value(f.recipe, k, False)
            per_token += values * (1 + scales)
            fixed += copies_weights * weights * (
                1 + with_scales * scale_bytes_per_value(f.recipe, k, True))
            held += weights
        out[i] = (per_token, fixed, held)
    return out


def _layers(run: RunConfig, model: nn.Module, with_scales: bool, cache: dict | None):
    par = run.parallel
    key = (par.tensor_model_parallel_size, par.expert_model_parallel_size,
           par.expert_tensor_parallel_size, with_scales)
    layers = cache.get(key) if cache is not None else None
    if layers is None:
        layers = _per_layer(run, model, with_scales)
        if cache is not None:
            cache[key] = layers
    return layers


def fp8_primary_values(run: RunConfig, model: nn.Module | None,
                       cache: dict | None = None) -> int:
    """--fp8-param-gather: the FP8 GEMMs' weight values one rank of the largest pipeline
    stage holds in FP8 (1 byte each instead of the model dtype's; decoder layers only, as
    the copies)."""
    if model is None or not run.fp8.enabled or not run.fp8.param_gather:
        return 0
    layers = _layers(run, model, False, cache)
    return int(max(sum(layers.get(i, (0, 0, 0))[2] for lo, hi in chunks
                       for i in range(lo, hi))
                   for chunks in run.parallel.layer_ranges(run.model.num_layers)))


def output_copy_bytes(run: RunConfig, tokens: int, with_scales: bool) -> float:
    """What the output layer's FP8 GEMMs keep per micro-batch of `tokens` on this rank
    (--fp8-output-proj; 0 without): per head, the input [tokens, H] and the weight's
    [V_local, H] real-vocabulary rows in FP8, plus their scales (module doc)."""
    f, m, tp = run.fp8, run.model, run.parallel.tensor_model_parallel_size
    if not (f.enabled and f.output_proj):
        return 0.0
    h = m.hidden_size
    rows = min(m.padded_vocab_size // tp, m.vocab_size)  # TP rank 0: the most real rows
    scales = with_scales * scale_bytes_per_value(f.recipe, h, False)
    w_scales = with_scales * scale_bytes_per_value(f.recipe, h, True)
    return (1 + m.num_mtp_layers) * h * (tokens * (1 + scales) + rows * (1 + w_scales))


def fp8_copy_bytes(run: RunConfig, model: nn.Module | None, with_scales: bool = True,
                   cache: dict | None = None) -> int:
    """The FP8 copies autograd keeps on the most loaded pipeline stage (module doc);
    `with_scales=False`: the FP8 values alone (what the tests measure exactly). `cache`:
    a dict kept over calls for one model and FP8 config (the planner's layout search)
    that holds the per-layer bytes by TP, EP and ETP, the only sizes they depend on."""
    if model is None or not run.fp8.enabled:
        return 0
    par, m = run.parallel, run.model
    tokens = m.seq_length // par.context_parallel_size * run.train.micro_batch_size
    layers = _layers(run, model, with_scales, cache)
    ranks = par.layer_ranges(m.num_layers)
    pp = len(ranks)
    worst = 0.0
    for r, chunks in enumerate(ranks):
        vpp = len(chunks)
        flight = pp + (pp - 1 - 2 * r) / vpp if vpp > 1 else pp - r
        stage = sum(tokens * layers.get(i, (0, 0, 0))[0] + layers.get(i, (0, 0, 0))[1]
                    for lo, hi in chunks for i in range(lo, hi))
        if r == pp - 1:  # the last virtual stage: the output layer
            stage += output_copy_bytes(run, tokens, with_scales)
        worst = max(worst, flight * stage)
    return int(worst)


def fp8_report(run: RunConfig, model: nn.Module | None) -> dict | None:
    """{"format", "recipe", "gemms", "amax_history_bytes_per_rank",
    "fp8_copy_bytes_per_rank"} of the largest pipeline stage, from the (meta)
    single-process model; None without FP8."""
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
    gemms += bool(f.output_proj and model is not None)  # the output layer (MXFP8: no state)
    num_layers = run.model.num_layers
    stage = max(sum(hi - lo for lo, hi in chunks)
                for chunks in par.layer_ranges(num_layers))
    per_rank = tensors * stage / num_layers  # GEMMs per layer are the same in every layer
    state = (f.amax_history_len + 1) * 4 if f.recipe == "delayed" else 0
    return {"format": f.format, "recipe": f.recipe, "gemms": gemms,
            "amax_history_bytes_per_rank": int(per_rank * state),
            "fp8_copy_bytes_per_rank": fp8_copy_bytes(run, model),
            "fp8_primary_weight_values_per_rank": fp8_primary_values(run, model)}
