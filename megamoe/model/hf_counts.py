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


def hf_num_parameters(cfg: dict) -> tuple[int, int]:
    """(total, active) parameters of the model `cfg` (a config.json dict) describes."""
    family = family_of_config(cfg)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    rest = vocab * h + h  # embedding, final norm
    if not cfg.get("tie_word_embeddings", False):
        rest += vocab * h
    layers = [_layer(cfg, family.name, bool(m)) for m in family.layer_pattern(cfg)]
    return rest + sum(t for t, _ in layers), rest + sum(a for _, a in layers)
