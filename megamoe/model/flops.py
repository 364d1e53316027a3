"""Parameter and FLOP counts by formula (no model needed: usable for planning and MFU).

`num_parameters` must equal `sum(p.numel() for p in GPTModel(config).parameters())`; the
tests check it for many configurations.

FLOPs per token (forward + backward), as in Megatron / PaLM MFU accounting:

    flops_per_token = 6 * M  +  12 * L * S * Nq * D

- M = matmul weights one token actually multiplies by: per layer QKV (H x (Nq + 2 Nkv) D)
  and output projection (Nq D x H); dense MLP (H x F(x2 when gated) + F x H) or, on MoE
  layers, the router (H x E) plus k experts' fc1/fc2; and the output layer over the real
  vocabulary (V x H; padded rows are never multiplied). Embedding lookups, norms, biases,
  activations and RoPE are not matmuls and are left out. 6 = 2 (multiply-add) x 3 (forward,
  grad wrt input, grad wrt weight).
- Attention core: QK^T and AV are each 2 * S * Nq * D FLOPs per token forward, x3 for
  forward + backward = 12 * S * Nq * D per layer (multi-latent attention: 6 * S * Nq *
  (qk + pos + v head dims); its matmul weights are the down / up / output projections).
  This counts the full S x S score matrix (no causal halving), the convention of
  Megatron's classic MFU formula and PaLM, so MFU numbers are comparable with theirs.
  GQA does not reduce it (every query head attends).
"""

from __future__ import annotations

from typing import Callable, Optional

from megamoe.config import ModelConfig, RecomputeConfig


def _norm_params(config: ModelConfig) -> int:
    return config.hidden_size * (2 if config.normalization == "LayerNorm" else 1)


def _mla_params(config: ModelConfig) -> tuple[int, int]:
    """(all parameters, matmul weights) of one multi-latent attention (model/mla.py): the
    down and up projections, the latent norms (--qk-layernorm) and the output projection."""
    h, n, r = config.hidden_size, config.num_attention_heads, config.q_lora_rank
    q_out = n * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    kv_r = config.kv_lora_rank
    weights = h * q_out if r is None else h * r + r * q_out
    weights += h * (kv_r + config.qk_pos_emb_head_dim)
    weights += kv_r * n * (config.qk_head_dim + config.v_head_dim)
    weights += n * config.v_head_dim * h
    per_channel = 2 if config.normalization == "LayerNorm" else 1
    norms = per_channel * (kv_r + (r or 0)) if config.qk_layernorm else 0
    return weights + norms + (h if config.add_bias_linear else 0), weights


def attention_core_width(config: ModelConfig) -> int:
    """Channels per token the attention core multiplies, QK^T plus AV, over all heads:
    2 Nq D, or Nq (qk + pos + v head dims) with multi-latent attention."""
    if config.multi_latent_attention:
        return config.num_attention_heads * (config.qk_head_dim + config.qk_pos_emb_head_dim
                                             + config.v_head_dim)
    return 2 * config.num_attention_heads * config.kv_channels


def _attention_params(config: ModelConfig) -> tuple[int, int]:
    """(all attention parameters, matmul weights) of one layer."""
    if config.multi_latent_attention:
        return _mla_params(config)
    h, d = config.hidden_size, config.kv_channels
    qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * d
    q_size = config.num_attention_heads * d
    weights = h * qkv_out + q_size * h
    bias = (qkv_out + h) if config.add_bias_linear else (qkv_out if config.add_qkv_bias else 0)
    qk_norms = 2 * _norm_params(config) // h * d if config.qk_layernorm else 0
    if config.qk_layernorm and config.qk_layernorm_scope == "projection":
        qk_norms = (config.num_attention_heads + config.num_query_groups) * d  # RMSNorm
    return weights + bias + qk_norms, weights


def _ffn_params(config: ModelConfig, ffn: int) -> tuple[int, int]:
    """(all parameters, matmul weights) of one fc1 -> act -> fc2 MLP (dense or one expert)."""
    h = config.hidden_size
    fc1_out = 2 * ffn if config.gated_linear_unit else ffn
    weights = h * fc1_out + ffn * h
    bias = (fc1_out + h) if config.add_bias_linear else 0
    return weights + bias, weights


def _layer_params(config: ModelConfig, i: int) -> tuple[int, int, int]:
    """(total, active per token, active matmul weights) of layer i."""
    attn, attn_mm = _attention_params(config)
    base = 2 * _norm_params(config) + attn
    if not config.is_moe_layer(i):
        mlp, mlp_mm = _ffn_params(config, config.ffn_hidden_size)
        return base + mlp, base + mlp, attn_mm + mlp_mm
    moe = config.moe
    expert, expert_mm = _ffn_params(config, moe.ffn_hidden_size)
    router = moe.num_experts * config.hidden_size
    shared, shared_mm = 0, 0  # every token also passes the shared experts (and their gate)
    if moe.shared_expert_intermediate_size is not None:
        shared, shared_mm = _ffn_params(config, moe.shared_expert_intermediate_size)
        gate = config.hidden_size if moe.shared_expert_gate else 0
        shared, shared_mm = shared + gate, shared_mm + gate
    total = base + router + shared + moe.num_experts * expert
    active = base + router + shared + moe.topk * expert
    return total, active, attn_mm + router + shared_mm + moe.topk * expert_mm


def _embedding_params(config: ModelConfig) -> int:
    n = config.padded_vocab_size * config.hidden_size
    if config.position_embedding_type == "learned_absolute":
        n += config.max_position_embeddings * config.hidden_size
    if config.untie_embeddings_and_output_weights:
        n += config.padded_vocab_size * config.hidden_size
    return n + _norm_params(config)  # + final norm


def _all_layer_params(config: ModelConfig) -> list[tuple[int, int, int]]:
    """_layer_params of the decoder layers, then of each MTP depth (model/mtp.py): its
    transformer layer (the last decoder layer's kind) plus enorm, hnorm, final norm and
    eh_proj (2H -> H, no bias); the MTP head's logits are counted in
    active_matmul_parameters."""
    out = [_layer_params(config, i) for i in range(config.num_layers)]
    h = config.hidden_size
    extra = 3 * _norm_params(config) + 2 * h * h
    for k in range(config.num_mtp_layers):
        total, active, mm = _layer_params(config, config.num_layers + k)
        out.append((total + extra, active + extra, mm + 2 * h * h))
    return out


def num_parameters(config: ModelConfig) -> tuple[int, int]:
    """(total parameters, parameters active for one token: k of E experts per MoE layer);
    MTP modules included (they share the embedding and output layer)."""
    layers = _all_layer_params(config)
    rest = _embedding_params(config)
    return rest + sum(t for t, _, _ in layers), rest + sum(a for _, a, _ in layers)


def output_matmul_parameters(config: ModelConfig) -> int:
    """Output-layer weights one token is multiplied by: the real vocabulary's rows, once
    per prediction (1 + --mtp-num-layers: the MTP depths run the same output layer)."""
    return config.vocab_size * config.hidden_size * (1 + config.num_mtp_layers)


def active_matmul_parameters(config: ModelConfig) -> int:
    """Weights one token is multiplied by (the M of the module docstring): the output
    layer once per prediction (1 + --mtp-num-layers)."""
    return output_matmul_parameters(config) + sum(mm for _, _, mm in _all_layer_params(config))


def flops_per_token(config: ModelConfig) -> float:
    """Model FLOPs (forward + backward) per trained token; see the module docstring (MTP
    layers count as layers)."""
    attn_core = 6 * (config.num_layers + config.num_mtp_layers) * config.seq_length * (
        attention_core_width(config))
    return float(6 * active_matmul_parameters(config) + attn_core)


def fp8_excluded_weights(config: ModelConfig, i: int) -> int:
    """Matmul weights per token of layer i (decoder, or MTP from num_layers on) that the
    FP8 policy (model/fp8/policy.py) leaves in high precision inside an FP8 layer: the
    router and the shared-expert gate (raw parameters, not the linears it converts)."""
    if not config.is_moe_layer(i):
        return 0
    moe, h = config.moe, config.hidden_size
    gate = moe.shared_expert_intermediate_size is not None and moe.shared_expert_gate
    return moe.num_experts * h + (h if gate else 0)


def fp8_flops_per_token(config: ModelConfig, fp8_layer: Callable[[int], bool],
                        fp8_wgrad: bool = True) -> float:
    """Model FLOPs per token of the GEMMs that run in FP8: the matmul weights of every
    layer `fp8_layer(i)` accepts (decoder layers, then MTP layers from num_layers on)
    less `fp8_excluded_weights`; never the attention core or the output layer. 6 FLOPs per
    weight (forward, dgrad, wgrad), 4 when the weight gradient stays in high precision
    (--no-fp8-wgrad)."""
    per_weight = 6 if fp8_wgrad else 4
    return float(sum(per_weight * (mm - fp8_excluded_weights(config, i))
                     for i, (_, _, mm) in enumerate(_all_layer_params(config))
                     if fp8_layer(i)))


def recompute_flops_per_token(config: ModelConfig, recompute: RecomputeConfig,
                              fp8_layer: Optional[Callable[[int], bool]] = None) -> float:
    """The forward FLOPs per token that activation recompute runs again in backward (not
    model FLOPs: MFU leaves them out, step time pays them). Elementwise replays (moe_act,
    layernorm) cost no GEMM. With `fp8_layer` (as fp8_flops_per_token): only the replayed
    GEMMs that run in FP8 (no attention core, router or shared-expert gate)."""
    fp8 = fp8_layer is not None
    core = 0 if fp8 else 2 * config.seq_length * attention_core_width(config)  # QK^T, AV
    layers = _all_layer_params(config)
    keep = [not fp8 or fp8_layer(i) for i in range(len(layers))]
    kept_out = [fp8_excluded_weights(config, i) if fp8 else 0 for i in range(len(layers))]
    if recompute.granularity == "full":  # MTP layers: with the uniform method (Megatron)
        n = config.num_layers + (config.num_mtp_layers if recompute.method == "uniform" else 0)
        return float(sum(2 * (mm - kept_out[i]) + core
                         for i, (_, _, mm) in enumerate(layers[:n]) if keep[i]))
    selected, total = recompute.selected, 0.0
    _, attn_mm = _attention_params(config)
    up_proj = 2 * _mla_up_proj_weights(config) if "mla_up_proj" in selected else 0
    eh_proj = [0] * config.num_layers + [2 * config.hidden_size ** 2] * config.num_mtp_layers
    for i, (_, _, mm) in enumerate(layers):
        if not keep[i]:
            continue
        total += (core if "core_attn" in selected else 0) + up_proj
        mlp_mm = mm - attn_mm - eh_proj[i]
        if config.is_moe_layer(i):
            if "moe" in selected:
                total += 2 * (mlp_mm - kept_out[i])
            elif "shared_experts" in selected and config.moe.shared_expert_intermediate_size:
                total += 2 * _ffn_params(config, config.moe.shared_expert_intermediate_size)[1]
        elif "mlp" in selected:
            total += 2 * mlp_mm
    return total


def _mla_up_proj_weights(config: ModelConfig) -> int:
    """Weights of MLA's up projections (what --recompute-modules mla_up_proj reruns)."""
    n = config.num_attention_heads
    q_in = config.hidden_size if config.q_lora_rank is None else config.q_lora_rank
    return (q_in * n * (config.qk_head_dim + config.qk_pos_emb_head_dim)
            + config.kv_lora_rank * n * (config.qk_head_dim + config.v_head_dim))


def attention_tp_replicated(config: ModelConfig) -> int:
    """Attention parameters every TP rank holds whole besides linear_proj's bias: MLA's
    down projections and latent norms (model/mla.py); none for SelfAttention."""
    if not config.multi_latent_attention:
        return 0
    h, r, kv_r = config.hidden_size, config.q_lora_rank, config.kv_lora_rank
    n = h * (r or 0) + h * (kv_r + config.qk_pos_emb_head_dim)
    per_channel = 2 if config.normalization == "LayerNorm" else 1
    return n + (per_channel * (kv_r + (r or 0)) if config.qk_layernorm else 0)


def largest_attention_weight(config: ModelConfig, tp: int) -> int:
    """Elements of the largest attention weight one TP rank holds."""
    h, n = config.hidden_size, config.num_attention_heads
    if not config.multi_latent_attention:
        return (n + 2 * config.num_query_groups) * config.kv_channels * h // tp
    q_in = h if config.q_lora_rank is None else config.q_lora_rank
    q_head = config.qk_head_dim + config.qk_pos_emb_head_dim
    return max(q_in * n * q_head // tp, h * (config.kv_lora_rank + config.qk_pos_emb_head_dim),
               config.kv_lora_rank * n * (config.qk_head_dim + config.v_head_dim) // tp,
               n * config.v_head_dim * h // tp, h * (config.q_lora_rank or 0))
