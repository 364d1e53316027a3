"""Activation bytes one transformer layer keeps for backward, per recompute mode.

Counted as megamoe's layers keep them (checked against measured bytes, within 25%, by
tests/planning/test_activations.py and tools/bench_activation_memory.py), in values per
token of the layer's sequence, per rank:

  attention  norm1 (RMSNorm keeps its input and the normalised input, LayerNorm its input),
             qkv's input (the gathered sequence under SP: not divided by TP), q k v, the
             q and k the --qk-layernorm norms keep, the rotated q and k (RoPE), the
             attention output (= linear_proj's input) and the
             softmax statistics (fp32, one per head: flash-style SDPA keeps no scores);
  MLP        norm2, the MLP input (gathered under SP), then
             dense: fc1's output, silu(gate) (SwiGLU) and the activation;
             MoE: the router's fp32 logits and probabilities, per routed copy fc1's output
             and the activation (the fused SwiGLU keeps nothing else), the all-to-all
             buffers under EP; shared experts like a dense MLP split over TP (plus, with
             their gate, the output the gate scales).

Recompute (megamoe/config/recompute.py) removes:
  core_attn       the softmax statistics only (the region's inputs q k v and its output are
                  kept anyway): with flash-style attention it saves little, as Megatron warns;
  layernorm       the norm outputs that linear layers keep (only without TP: under SP they
                  keep the gathered sequence instead);
  moe_act         the experts' activation (fc2's input);
  moe / mlp       everything of the MoE / dense MLP and norm2: the region keeps its input;
  shared_experts  the shared experts' tensors;
  mla_up_proj     multi-latent attention's q k v (recomputed from the latents);
  full            whole layers: a checkpointed group keeps its input only (the replay of one
                  group during backward is the stage's transient, memory.activation_bytes).
"""

from __future__ import annotations

from megamoe.config import ModelConfig, RecomputeConfig

FP32 = 4


def _norm(model: ModelConfig) -> float:
    return 2.0 if model.normalization == "RMSNorm" else 1.0


def mla_attention_values(model: ModelConfig, tp: int, act_bytes: int,
                         recompute: RecomputeConfig) -> float:
    """Multi-latent attention (model/mla.py): norm1, the down projections' input (this
    rank's sequence shard), the latents (the norm inputs on the shard, the up projections'
    gathered inputs), q k v (dropped by mla_up_proj: recomputed), the attention output
    and the softmax statistics."""
    h, n, selected = model.hidden_size, model.num_attention_heads, recompute.selected
    q_head = model.qk_head_dim + model.qk_pos_emb_head_dim
    values = _norm(model) * h / tp
    if not ("layernorm" in selected and tp == 1):
        values += h / tp
    norm = 1.0 if model.qk_layernorm else 0.0
    r = model.q_lora_rank
    values += h if r is None else r * (1 + norm / tp)  # q's up projection input
    values += model.kv_lora_rank * (1 + norm / tp) + model.qk_pos_emb_head_dim
    if "mla_up_proj" not in selected:
        values += n * (2 * q_head + model.v_head_dim) / tp
    values += n * model.v_head_dim / tp
    if "core_attn" not in selected:
        values += n * FP32 / act_bytes / tp
    return values


def attention_values(model: ModelConfig, tp: int, act_bytes: int,
                     recompute: RecomputeConfig) -> float:
    if model.multi_latent_attention:
        return mla_attention_values(model, tp, act_bytes, recompute)
    h, d = model.hidden_size, model.kv_channels
    nq, nkv = model.num_attention_heads, model.num_query_groups
    selected = recompute.selected
    values = _norm(model) * h / tp
    if not ("layernorm" in selected and tp == 1):
        values += h  # linear_qkv's input
    rotated = (nq + nkv) * d if model.position_embedding_type == "rope" else 0
    qk_norms = (nq + nkv) * d if model.qk_layernorm else 0  # the per-head norms' inputs
    values += ((nq + 2 * nkv) * d + rotated + qk_norms + nq * d) / tp
    if "core_attn" not in selected:
        values += nq * FP32 / act_bytes / tp
    return values


def _dense_mlp(h: int, f: int, gated: bool, tp: int) -> float:
    """fc1's output, act(gate) when gated (SwiGLU, quick GeGLU), the activation (fc2's
    input)."""
    return ((2 * f + f + f) if gated else (f + f)) / tp


def moe_values(model: ModelConfig, tp: int, ep: int, etp: int, act_bytes: int,
               recompute: RecomputeConfig) -> float:
    """The routed experts, router and shared experts of an MoE layer (without norm2 and the
    layer input), values per token."""
    m, h, f = model.moe, model.hidden_size, model.moe.ffn_hidden_size
    fc1 = 2 * f if model.gated_linear_unit else f
    act = 0 if "moe_act" in recompute.selected else f
    copy = (fc1 + act) / etp
    if ep > 1:
        copy += 2 * h  # the tokens received and the expert outputs sent back
    elif not (model.swiglu or f <= h):
        copy += h  # GELU experts wider than H weight the output
    values = m.topk * copy + (2 * m.topk * h if ep > 1 else 0)
    values += 3 * m.num_experts * FP32 / act_bytes  # fp32 logits, scores, probabilities
    shared = m.shared_expert_intermediate_size
    if shared is not None and "shared_experts" not in recompute.selected:
        # A TP MLP on the layer's sequence shard: under SP fc1 keeps the gathered input
        # (without TP it is the router's input, counted above); the gate keeps the output.
        values += _dense_mlp(h, shared, model.gated_linear_unit, tp) + (h if tp > 1 else 0)
        if m.shared_expert_gate:
            values += h / tp
    return values


def routing_replay_values(model: ModelConfig, i: int, tp: int, act_bytes: int) -> float:
    """What a recomputed MoE layer keeps for its replay (parallel/checkpointing.replay_once):
    the forward's top-k expert ids, int64 per routed token (the router sees the layer's
    sequence shard under SP), so the replay routes exactly as the forward did."""
    if not model.is_moe_layer(i) or model.moe.router_type != "topk":
        return 0.0
    return model.moe.topk * 8 / act_bytes / tp


def mlp_values(model: ModelConfig, i: int, tp: int, ep: int, etp: int, act_bytes: int,
               recompute: RecomputeConfig) -> float:
    h = model.hidden_size
    selected = recompute.selected
    moe = model.is_moe_layer(i)
    if ("moe" if moe else "mlp") in selected:
        # the checkpointed region (norm2 + MLP) keeps its input, and an MoE layer its routing
        return h / tp + routing_replay_values(model, i, tp, act_bytes)
    values = _norm(model) * h / tp
    if not ("layernorm" in selected and tp == 1):
        values += h  # the MLP's / router's input
    if moe:
        return values + moe_values(model, tp, ep, etp, act_bytes, recompute)
    return values + _dense_mlp(h, model.ffn_hidden_size, model.gated_linear_unit, tp)


def layer_values(model: ModelConfig, i: int, recompute: RecomputeConfig, *, tp: int = 1,
                 ep: int = 1, etp: int = 1, act_bytes: int = 2) -> float:
    """Values per token layer `i` keeps when it is not in a full-recompute group."""
    return (attention_values(model, tp, act_bytes, recompute)
            + mlp_values(model, i, tp, ep, etp, act_bytes, recompute))


def layer_activation_bytes(model: ModelConfig, i: int, recompute: RecomputeConfig, *,
                           tokens: int, act_bytes: int = 2, tp: int = 1, ep: int = 1,
                           etp: int = 1) -> float:
    """Bytes layer `i` keeps for `tokens` tokens of its sequence; a layer of a full
    recompute group (uniform, one layer per group) keeps only its input."""
    if recompute.granularity == "full":
        return tokens * act_bytes * (model.hidden_size / tp
                                     + routing_replay_values(model, i, tp, act_bytes))
    return tokens * act_bytes * layer_values(model, i, recompute, tp=tp, ep=ep, etp=etp,
                                             act_bytes=act_bytes)


RECOMPUTE_MODES = {
    "none": RecomputeConfig(),
    "selective": RecomputeConfig(granularity="selective"),  # core_attn, Megatron's default
    "selective:moe_act": RecomputeConfig(granularity="selective", modules=["moe_act"]),
    "selective:moe": RecomputeConfig(granularity="selective", modules=["moe"]),
    "full": RecomputeConfig(granularity="full", method="uniform", num_layers=1),
}


def recompute_config(name: str) -> RecomputeConfig:
    """A Layout's recompute name -> its config: "none", "full" (uniform, 1 layer per
    group), "selective" (core_attn) or "selective:<module>[,<module>...]"."""
    if name in RECOMPUTE_MODES:
        return RECOMPUTE_MODES[name]
    if name.startswith("selective:"):
        return RecomputeConfig(granularity="selective", modules=name[10:].split(","))
    raise ValueError(f"unknown recompute mode {name!r}")


def recompute_name(config: RecomputeConfig) -> str:
    """The inverse of recompute_config for a run's flags (full with any method or group
    size is modelled as full: each group keeps one input, replays one group at a time)."""
    if config.granularity == "full":
        return "full"
    if config.granularity == "selective" and config.selected:
        return "selective:" + ",".join(config.selected)
    return "none"


def recompute_flags(name: str) -> list[str]:
    """The pretrain_gpt.py flags of a Layout's recompute mode."""
    config = recompute_config(name)
    if config.granularity == "full":
        return ["--recompute-granularity=full", f"--recompute-method={config.method}",
                f"--recompute-num-layers={config.num_layers}"]
    if config.granularity == "selective":
        return ["--recompute-granularity=selective",
                "--recompute-modules", *config.selected]
    return []
