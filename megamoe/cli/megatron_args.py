"""Megatron-LM's saved `args` Namespace <-> pretrain_gpt.py flags, for checkpoint conversion.

Megatron-LM saves its whole argparse Namespace in every checkpoint; the model's shape and
the run's schedule are read from it here, field by field, each checked for type and
range (the checkpoint may come from anywhere). A field that changes the network in a way
megamoe does not convert yet (`apply_layernorm_1p`, `mtp_hsm`, ...) is
refused with one line naming the Megatron field (MLA and MTP are read: MLA_FIELDS,
MTP_FIELDS); fields that only describe the run's
bookkeeping (paths, logging, kernels) are ignored. The reverse direction writes the same
field names, so Megatron-LM's `--use-checkpoint-args` and megatron-core read them.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Optional

from megamoe.config import ModelConfig


class MegatronArgsError(ValueError):
    """A saved Megatron field megamoe cannot use; the message names it."""


def _int(lo: int = 1) -> Callable[[str, Any], int]:
    def check(name: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or v > 2**40:
            raise MegatronArgsError(f"args.{name} = {v!r}: expected an integer >= {lo}")
        return v
    return check


def _float(lo: float = 0.0, hi: float = math.inf) -> Callable[[str, Any], float]:
    def check(name: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise MegatronArgsError(f"args.{name} = {v!r}: expected a number in [{lo}, {hi}]")
        return float(v)
    return check


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise MegatronArgsError(f"args.{name} = {v!r}: expected True or False")
    return v


def _choice(*options: str) -> Callable[[str, Any], str]:
    def check(name: str, v: Any) -> str:
        if v not in options:
            raise MegatronArgsError(f"args.{name} = {v!r}: expected one of {list(options)}")
        return v
    return check


def _layer_freq(name: str, v: Any) -> str:
    if isinstance(v, list) and all(x in (0, 1) and not isinstance(x, bool) for x in v):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(_int()(name, v))


def _str_list(name: str, v: Any) -> list[str]:
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise MegatronArgsError(f"args.{name} = {v!r}: expected a list of names")
    return v


def _float_list(name: str, v: Any) -> list[float]:
    v = [v] if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    if not isinstance(v, list):
        raise MegatronArgsError(f"args.{name} = {v!r}: expected numbers")
    return [_float()(name, x) for x in v]


# Megatron field -> (flag, checker). A bool field maps to a store_true flag.
MODEL_FIELDS: dict[str, tuple[str, Callable]] = {
    "num_layers": ("--num-layers", _int()),
    "hidden_size": ("--hidden-size", _int()),
    "ffn_hidden_size": ("--ffn-hidden-size", _int()),
    "num_attention_heads": ("--num-attention-heads", _int()),
    "group_query_attention": ("--group-query-attention", _bool),
    "num_query_groups": ("--num-query-groups", _int()),
    "kv_channels": ("--kv-channels", _int()),
    "seq_length": ("--seq-length", _int()),
    "max_position_embeddings": ("--max-position-embeddings", _int()),
    "make_vocab_size_divisible_by": ("--make-vocab-size-divisible-by", _int()),
    "normalization": ("--normalization", _choice("RMSNorm")),
    "norm_epsilon": ("--norm-epsilon", _float(0.0, 1.0)),
    "position_embedding_type": ("--position-embedding-type", _choice("rope")),
    "rotary_base": ("--rotary-base", _float(1.0)),
    "rotary_percent": ("--rotary-percent", _float(0.0, 1.0)),
    "swiglu": ("--swiglu", _bool),
    "squared_relu": ("--squared-relu", _bool),
    "quick_geglu": ("--quick-geglu", _bool),
    "rotary_interleaved": ("--rotary-interleaved", _bool),
    "use_rope_scaling": ("--use-rope-scaling", _bool),
    "rope_scaling_factor": ("--rope-scaling-factor", _float(1e-6, 1e6)),
    "untie_embeddings_and_output_weights": ("--untie-embeddings-and-output-weights", _bool),
    "qk_layernorm": ("--qk-layernorm", _bool),
    "add_qkv_bias": ("--add-qkv-bias", _bool),
    "hidden_dropout": ("--hidden-dropout", _float(0.0, 1.0)),
    "attention_dropout": ("--attention-dropout", _float(0.0, 1.0)),
    "init_method_std": ("--init-method-std", _float()),
    "num_experts": ("--num-experts", _int(0)),
    "moe_router_topk": ("--moe-router-topk", _int()),
    "moe_ffn_hidden_size": ("--moe-ffn-hidden-size", _int()),
    "moe_layer_freq": ("--moe-layer-freq", _layer_freq),
    "moe_shared_expert_intermediate_size": ("--moe-shared-expert-intermediate-size", _int()),
    "moe_shared_expert_gate": ("--moe-shared-expert-gate", _bool),
    "moe_router_score_function": ("--moe-router-score-function",
                                  _choice("softmax", "sigmoid")),
    "moe_router_enable_expert_bias": ("--moe-router-enable-expert-bias", _bool),
    "moe_router_pre_softmax": ("--moe-router-pre-softmax", _bool),
    "moe_router_topk_scaling_factor": ("--moe-router-topk-scaling-factor", _float()),
    "moe_router_num_groups": ("--moe-router-num-groups", _int()),
    "moe_router_group_topk": ("--moe-router-group-topk", _int()),
    "moe_router_load_balancing_type": ("--moe-router-load-balancing-type", _str_list),
    "moe_aux_loss_coeff": ("--moe-aux-loss-coeff", _float_list),
    "moe_z_loss_coeff": ("--moe-z-loss-coeff", _float()),
}

# Multi-latent attention (with args.multi_latent_attention only: Megatron saves its
# defaults in every run) and multi-token prediction (with args.mtp_num_layers only).
_SCALE = _float(0.0, 1e6)
MLA_FIELDS: dict[str, tuple[str, Callable]] = {
    "multi_latent_attention": ("--multi-latent-attention", _bool),
    "q_lora_rank": ("--q-lora-rank", _int()),
    "kv_lora_rank": ("--kv-lora-rank", _int()),
    "qk_head_dim": ("--qk-head-dim", _int()),
    "qk_pos_emb_head_dim": ("--qk-pos-emb-head-dim", _int()),
    "v_head_dim": ("--v-head-dim", _int()),
    "rope_type": ("--rope-type", _choice("rope", "yarn")),
    "rotary_scaling_factor": ("--rotary-scaling-factor", _float(1e-6, 1e6)),
    "mscale": ("--mscale", _SCALE),
    "mscale_all_dim": ("--mscale-all-dim", _SCALE),
}
MTP_FIELDS: dict[str, tuple[str, Callable]] = {
    "mtp_num_layers": ("--mtp-num-layers", _int()),
    "mtp_loss_scaling_factor": ("--mtp-loss-scaling-factor", _SCALE),
}

# The run's schedule: what --load needs to continue where Megatron stopped.
TRAIN_FIELDS: dict[str, tuple[str, Callable]] = {
    "micro_batch_size": ("--micro-batch-size", _int()),
    "global_batch_size": ("--global-batch-size", _int()),
    "train_iters": ("--train-iters", _int()),
    "train_samples": ("--train-samples", _int()),
    "lr": ("--lr", _float()),
    "min_lr": ("--min-lr", _float()),
    "lr_decay_style": ("--lr-decay-style", _choice("constant", "linear", "cosine",
                                                   "inverse-square-root", "WSD")),
    "lr_warmup_iters": ("--lr-warmup-iters", _int(0)),
    "lr_warmup_samples": ("--lr-warmup-samples", _int(0)),
    "lr_warmup_fraction": ("--lr-warmup-fraction", _float(0.0, 1.0)),
    "lr_decay_iters": ("--lr-decay-iters", _int()),
    "lr_decay_samples": ("--lr-decay-samples", _int()),
    "weight_decay": ("--weight-decay", _float()),
    "adam_beta1": ("--adam-beta1", _float(0.0, 1.0)),
    "adam_beta2": ("--adam-beta2", _float(0.0, 1.0)),
    "adam_eps": ("--adam-eps", _float(0.0, 1.0)),
    "clip_grad": ("--clip-grad", _float()),
    "seed": ("--seed", _int(0)),
}

# Fields that change the network in ways not converted yet: (field, the value that is fine).
UNSUPPORTED: dict[str, Any] = {
    "apply_layernorm_1p": False, "mla_down_proj_fusion": False,
    "experimental_attention_variant": None, "mtp_use_repeated_layer": False,
    "mtp_detach_heads": False, "mtp_hsm": False,
    "add_bias_linear": False, "apply_residual_connection_post_layernorm": False,
    "openai_gelu": False, "moe_use_upcycling": False,
    "num_experts_per_layer": None, "heterogeneous_layers_config_path": None,
}


def _value(ns: argparse.Namespace, name: str) -> Any:
    return getattr(ns, name, None)


def flags_from_args(ns: argparse.Namespace) -> list[str]:
    """pretrain_gpt.py flags for the model and schedule a saved Megatron Namespace
    describes; MegatronArgsError names the first field that cannot be used."""
    for name, fine in UNSUPPORTED.items():
        v = _value(ns, name)
        if v not in ((None, 0) if fine is None else (fine, None)):
            raise MegatronArgsError(f"args.{name} = {v!r}: not supported yet by megamoe's "
                                    "Megatron-LM conversion")
    fields = dict(MODEL_FIELDS)
    if _bool("multi_latent_attention", _value(ns, "multi_latent_attention") or False):
        fields.update(MLA_FIELDS)
    if _value(ns, "mtp_num_layers") not in (None, 0):
        fields.update(MTP_FIELDS)
    flags: list[str] = []
    for name, (flag, check) in {**fields, **TRAIN_FIELDS}.items():
        v = _value(ns, name)
        if v is None or (name == "num_experts" and v == 0) or (
                name == "num_query_groups" and not _value(ns, "group_query_attention")) or (
                name == "rope_scaling_factor" and not _value(ns, "use_rope_scaling")):
            continue
        v = check(name, v)
        if isinstance(v, bool):
            flags += [flag] if v else []
        elif isinstance(v, list):
            flags += [flag, *map(str, v)]
        else:
            flags += [flag, str(v)]
    if not _value(ns, "add_bias_linear"):
        flags.append("--disable-bias-linear")
    if "--train-iters" in flags and "--train-samples" in flags:
        i = flags.index("--train-samples")
        del flags[i:i + 2]  # Megatron derives one from the other; iterations are primary
    return flags


def vocab_size_of(ns: argparse.Namespace) -> tuple[int, int]:
    """(vocab_size, padded_vocab_size) from the Namespace: the tokenizer's size if it was
    saved (NullTokenizer runs), else the padded size (rows past it are padding)."""
    padded = _int()("padded_vocab_size", _value(ns, "padded_vocab_size"))
    v = _value(ns, "vocab_size")
    return (padded if v is None else min(_int()("vocab_size", v), padded)), padded


def dtype_name(ns: argparse.Namespace) -> str:
    return "bf16" if _value(ns, "bf16") else "fp16" if _value(ns, "fp16") else "fp32"


# MLATransformerConfig's YaRN constants: Megatron-LM has no flag for them (MLA takes the
# dataclass defaults), so a model with others cannot be written as a Megatron-LM run.
MEGATRON_MLA_YARN = {"original_max_position_embeddings": 4096, "beta_fast": 32.0,
                     "beta_slow": 1.0}


def megatron_cannot_express(config: ModelConfig) -> Optional[str]:
    """Why a Megatron-LM run cannot hold this model (its args and megatron-core's MLA),
    or None."""
    if not config.multi_latent_attention:
        return None
    for name, megatron in MEGATRON_MLA_YARN.items():
        if getattr(config, name) != megatron:
            return (f"MLA's YaRN {name} is {getattr(config, name)}; Megatron-LM's MLA "
                    f"always uses {megatron} (no flag sets it)")
    if config.q_lora_rank is None and config.qk_layernorm:
        return ("MLA with --qk-layernorm and no --q-lora-rank: megatron-core (since "
                "July 2026, 0.19.2) adds a norm of the hidden states inside linear_q_proj, which "
                "megamoe's MLA does not have")
    return None


def _mla_mtp_fields(config: ModelConfig) -> dict[str, Any]:
    """MLA's and MTP's fields under Megatron's names (Megatron's defaults when off, as its
    Namespace holds them). `rope_type` None is Megatron's "MLA takes yarn"."""
    mla = {"multi_latent_attention": config.multi_latent_attention,
           **{name: getattr(config, name) for name in MLA_FIELDS
              if name != "multi_latent_attention"}}
    return {**mla, "mtp_num_layers": config.mtp_num_layers,
            "mtp_loss_scaling_factor": config.mtp_loss_scaling_factor,
            "mla_down_proj_fusion": False}


def megatron_namespace(saved_args: dict, config: ModelConfig, iteration: int,
                       consumed_samples: int, padded_vocab: int,
                       extra: Optional[dict] = None) -> argparse.Namespace:
    """Megatron-LM's Namespace for a megamoe run (saved argparse dests share Megatron's
    names; the model's own fields come from `config`, the authority on what was built)."""
    fields = {k: v for k, v in saved_args.items()
              if k in MODEL_FIELDS or k in TRAIN_FIELDS or k in ("bf16", "fp16", "vocab_size")}
    moe = config.moe
    fields.update(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size, num_attention_heads=config.num_attention_heads,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        num_query_groups=config.num_query_groups, kv_channels=config.kv_channels,
        seq_length=config.seq_length, max_position_embeddings=config.max_position_embeddings,
        normalization=config.normalization, norm_epsilon=config.norm_epsilon,
        position_embedding_type=config.position_embedding_type,
        rotary_base=int(config.rotary_base) if float(config.rotary_base).is_integer()
        else config.rotary_base, rotary_percent=config.rotary_percent,
        swiglu=config.swiglu, squared_relu=config.squared_relu, quick_geglu=config.quick_geglu,
        rotary_interleaved=config.rotary_interleaved, use_rope_scaling=config.use_rope_scaling,
        rope_scaling_factor=config.rope_scaling_factor, add_bias_linear=config.add_bias_linear,
        # as Megatron's validate_args leaves it (off without biases): which GELU ran
        bias_gelu_fusion=config.add_bias_linear and config.bias_gelu_fusion,
        add_qkv_bias=config.add_qkv_bias,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        qk_layernorm=config.qk_layernorm, vocab_size=config.vocab_size,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        num_experts=moe.num_experts if moe else None,
        moe_router_topk=moe.topk if moe else 2,
        moe_ffn_hidden_size=moe.ffn_hidden_size if moe else None,
        moe_layer_freq=list(config.moe_layer_pattern) if config.moe_layer_pattern
        and not all(config.moe_layer_pattern) else 1,
        moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size if moe else None,
        moe_shared_expert_gate=bool(moe and moe.shared_expert_gate),
        moe_router_score_function=moe.score_function if moe else "softmax",
        moe_router_enable_expert_bias=bool(moe and moe.enable_expert_bias),
        moe_router_pre_softmax=bool(moe and moe.pre_softmax),
        moe_router_topk_scaling_factor=moe.topk_scaling_factor if moe else None,
        **_mla_mtp_fields(config), apply_layernorm_1p=False,
        iteration=iteration, consumed_train_samples=consumed_samples,
        consumed_valid_samples=0, ckpt_format="torch_dist",
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        expert_model_parallel_size=1, **(extra or {}))
    return argparse.Namespace(**fields)
