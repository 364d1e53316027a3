"""Parameter counts of a Hugging Face MoE model computed from its config.json alone (the
families of hf_families.py), so a preset's size can be checked against the published
model's without downloading it: tests/test_configs.py asserts that each preset's megamoe
count (model/flops.py) equals this, and that this equals transformers' own count
(`sum(p.numel() for p in model.parameters())`) for models built from the same dicts.

"Active" is megamoe's meaning: everything but the experts a token does not use (k of E
routed experts per MoE layer; embeddings, router, shared experts and norms count).
"""

from __future__ import annotations

from megamoe.model.hf_families import family_of_config


def _attention(cfg: dict, family: str) -> int:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    q, k = heads * d, kv * d
    n = h * (q + 2 * k) + q * h
    if cfg.get("attention_bias"):
        n += q + 2 * k + h
    if family == "qwen2_moe" and cfg.get("qkv_bias", True):
        n += q + 2 * k
    if family == "qwen3_moe":
        n += 2 * d  # per-head q/k norms
    if family == "olmoe":
        n += h + (h // heads) * kv  # whole-projection q/k norms, as OlmoeAttention sizes them
    return n


def _layer(cfg: dict, family: str, moe: bool) -> tuple[int, int]:
    """(total, active) parameters of one decoder layer."""
    h = cfg["hidden_size"]
    base = 2 * h + _attention(cfg, family)  # input and post-attention norms
    if not moe:
        mlp = 3 * h * cfg["intermediate_size"]
        return base + mlp, base + mlp
    fam = family_of_config(cfg)
    experts, topk = fam.num_experts(cfg), cfg["num_experts_per_tok"]
    expert = 3 * h * fam.expert_ffn(cfg)
    always = h * experts  # router
    if family == "qwen2_moe":
        always += 3 * h * cfg["shared_expert_intermediate_size"] + h  # shared expert + gate
    return base + always + experts * expert, base + always + topk * expert


def _is_deepseek_v3(cfg: dict) -> bool:
    return (cfg.get("architectures") == ["DeepseekV3ForCausalLM"]
            or cfg.get("model_type") == "deepseek_v3")


def _mla(cfg: dict) -> int:
    """DeepseekV3Attention: q (through the q_lora_rank latent and its norm, or one
    projection), the k/v latent with the shared rotary key and its norm, kv_b, o_proj."""
    h, n, r, kv = (cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("q_lora_rank"),
                   cfg["kv_lora_rank"])
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q = h * n * (nope + rope) if r is None else h * r + r + r * n * (nope + rope)
    return q + h * (kv + rope) + kv + kv * n * (nope + v) + n * v * h


def _deepseek_v3_layer(cfg: dict, moe: bool) -> tuple[int, int]:
    """(total, active) of one DeepseekV3DecoderLayer (e_score_correction_bias is a
    buffer, not a parameter, in transformers as in megamoe)."""
    h = cfg["hidden_size"]
    base = 2 * h + _mla(cfg)
    if not moe:
        mlp = 3 * h * cfg["intermediate_size"]
        return base + mlp, base + mlp
    experts, expert = cfg["n_routed_experts"], 3 * h * cfg["moe_intermediate_size"]
    always = h * experts + 3 * h * cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    return (base + always + experts * expert,
            base + always + cfg["num_experts_per_tok"] * expert)


def _deepseek_v3(cfg: dict) -> tuple[int, int]:
    h, vocab, k = cfg["hidden_size"], cfg["vocab_size"], cfg["first_k_dense_replace"]
    rest = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2) + h
    layers = [_deepseek_v3_layer(cfg, i >= k) for i in range(cfg["num_hidden_layers"])]
    return rest + sum(t for t, _ in layers), rest + sum(a for _, a in layers)


def deepseek_v3_mtp_parameters(cfg: dict) -> tuple[int, int, int]:
    """(total, active) parameters of the MTP modules without the embedding and output head
    they share with the model, as megamoe holds them, and their total as DeepSeek's
    checkpoint files store them (each depth with its own copies of embed_tokens and
    shared_head.head). transformers builds no MTP module; `num_nextn_predict_layers`
    depths (0 if absent)."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    depths = cfg.get("num_nextn_predict_layers", 0)
    extra = 3 * h + 2 * h * h  # enorm, hnorm, shared_head.norm; eh_proj
    total, active = (extra + n for n in _deepseek_v3_layer(cfg, True))
    return depths * total, depths * active, depths * (total + 2 * vocab * h)


def hf_num_parameters(cfg: dict) -> tuple[int, int]:
    """(total, active) parameters of the model `cfg` (a config.json dict) describes, as
    transformers builds it (for DeepSeek-V3: without the MTP modules, see
    `deepseek_v3_mtp_parameters`)."""
    if _is_deepseek_v3(cfg):
        return _deepseek_v3(cfg)
    family = family_of_config(cfg)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    rest = vocab * h + h  # embedding, final norm
    if not cfg.get("tie_word_embeddings", False):
        rest += vocab * h
    layers = [_layer(cfg, family.name, bool(m)) for m in family.layer_pattern(cfg)]
    return rest + sum(t for t, _ in layers), rest + sum(a for _, a in layers)
