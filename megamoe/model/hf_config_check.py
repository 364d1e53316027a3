"""The type and range of every config.json field the Hugging Face families read, checked
before any of them is used.

A config.json comes from elsewhere and may be edited or damaged. Unchecked, a field of the
wrong type surfaces far from its cause: a traceback in the family's flag builder
(`architectures: 1.5`, `rope_parameters: inf`), or a pretrain_gpt.py flag error that names
our flag instead of the user's field (`hidden_size: true` -> "--hidden-size: invalid int
value"). Fields megamoe does not read are not checked (transformers writes many).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional


def _int(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v < 2**31


def _number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and abs(v) < 2**63)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(_int(0)(x) for x in v)


def _strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


POSITIVE, COUNT = _int(1), _int(0)

# field -> (accepts, what it must be, None allowed)
FIELDS: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    "architectures": (_strs, "a list of strings", True),
    "model_type": (_str, "a string", True),
    "hidden_act": (_str, "a string", True),
    "scoring_func": (_str, "a string", True),
    "vocab_size": (POSITIVE, "a positive integer", False),
    "hidden_size": (POSITIVE, "a positive integer", False),
    "intermediate_size": (POSITIVE, "a positive integer", False),
    "moe_intermediate_size": (POSITIVE, "a positive integer", False),
    "shared_expert_intermediate_size": (COUNT, "a non-negative integer", True),
    "num_hidden_layers": (POSITIVE, "a positive integer", False),
    "num_attention_heads": (POSITIVE, "a positive integer", False),
    "num_key_value_heads": (POSITIVE, "a positive integer", True),
    "head_dim": (POSITIVE, "a positive integer", True),
    "max_position_embeddings": (POSITIVE, "a positive integer", False),
    "num_local_experts": (POSITIVE, "a positive integer", False),
    "num_experts": (POSITIVE, "a positive integer", False),
    "n_routed_experts": (POSITIVE, "a positive integer", False),
    "num_experts_per_tok": (POSITIVE, "a positive integer", False),
    "n_shared_experts": (COUNT, "a non-negative integer", True),
    "n_group": (POSITIVE, "a positive integer", True),
    "topk_group": (POSITIVE, "a positive integer", False),
    "first_k_dense_replace": (COUNT, "a non-negative integer", False),
    "decoder_sparse_step": (COUNT, "a non-negative integer", True),
    "moe_layer_freq": (POSITIVE, "a positive integer", True),
    "num_nextn_predict_layers": (COUNT, "a non-negative integer", False),
    "q_lora_rank": (POSITIVE, "a positive integer", True),
    "kv_lora_rank": (POSITIVE, "a positive integer", False),
    "qk_nope_head_dim": (POSITIVE, "a positive integer", False),
    "qk_rope_head_dim": (POSITIVE, "a positive integer", False),
    "v_head_dim": (POSITIVE, "a positive integer", False),
    "sliding_window": (COUNT, "a non-negative integer", True),
    "mlp_only_layers": (_ints, "a list of layer numbers", True),
    "rope_theta": (_number, "a finite number", False),
    "rms_norm_eps": (_number, "a finite number", False),
    "attention_dropout": (_number, "a finite number", False),
    "initializer_range": (_number, "a finite number", False),
    "router_aux_loss_coef": (_number, "a finite number", False),
    "routed_scaling_factor": (_number, "a finite number", False),
    "clip_qkv": (_number, "a finite number", True),
    "tie_word_embeddings": (_bool, "true or false", False),
    "norm_topk_prob": (_bool, "true or false", False),
    "attention_bias": (_bool, "true or false", False),
    "qkv_bias": (_bool, "true or false", False),
    "use_sliding_window": (_bool, "true or false", False),
}
# the rotary parameters (rope_parameters / rope_scaling, a dict or null)
ROPE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "rope_type": (_str, "a string"), "type": (_str, "a string"),
    "rope_theta": (_number, "a finite number"), "factor": (_number, "a finite number"),
    "mscale": (_number, "a finite number"), "mscale_all_dim": (_number, "a finite number"),
    "original_max_position_embeddings": (POSITIVE, "a positive integer"),
    "beta_fast": (_number, "a finite number"), "beta_slow": (_number, "a finite number"),
}


def _shown(v: Any) -> str:
    """A short description of a bad value (its type, or the number)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return repr(v) if len(repr(v)) <= 24 else type(v).__name__
    return type(v).__name__ if not isinstance(v, bool) else repr(v).lower()


REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def config_field_error(cfg: Any) -> Optional[str]:
    """Why a parsed config.json cannot be read (the field and what it must be), or None."""
    if not isinstance(cfg, dict):
        return f"must hold a JSON object, found {type(cfg).__name__}"
    missing = [f for f in REQUIRED if f not in cfg]
    if missing:
        return f"field {missing[0]!r} is missing"
    for field, (accepts, must, nullable) in FIELDS.items():
        if field in cfg and not (cfg[field] is None and nullable) and not accepts(cfg[field]):
            return f"field {field!r} must be {must}, found {_shown(cfg[field])}"
    for rope_key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(rope_key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            return f"field {rope_key!r} must be an object or null, found {_shown(rope)}"
        for field, (accepts, must) in ROPE_FIELDS.items():
            if field in rope and rope[field] is not None and not accepts(rope[field]):
                return f"field {rope_key}.{field!r} must be {must}, found {_shown(rope[field])}"
    return None
