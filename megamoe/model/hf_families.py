"""The Hugging Face MoE families megamoe converts, each a pluggable `HFFamily`:

    family      HF class               what it adds to the Mixtral-style decoder
    mixtral     MixtralForCausalLM     -
    qwen2_moe   Qwen2MoeForCausalLM    QKV bias, a shared expert with a sigmoid gate,
                                       dense layers (mlp_only_layers, decoder_sparse_step)
    qwen3_moe   Qwen3MoeForCausalLM    per-head q/k RMSNorm (--qk-layernorm), head_dim,
                                       dense layers
    olmoe       OlmoeForCausalLM       q/k RMSNorm over the whole projections
                                       (--qk-layernorm-scope projection)
    deepseek_v3 DeepseekV3ForCausalLM  multi-latent attention (YaRN), sigmoid group-limited
                                       routing with a correction bias, shared experts,
                                       dense first layers, MTP layers

A family knows (1) which config.json it reads and why it refuses one (`config_error`),
(2) the pretrain_gpt.py flags that build the same network (`flags`), (3) whether a
megamoe model fits it (`export_error`) and (4) its config.json fields for a model
(`config_fields`), plus its weight names (`weights`, hf_mapping.WeightMap). Routing maps
as Megatron's: HF's softmax over all experts then top-k, renormalised when norm_topk_prob
(Mixtral: always), equals Megatron's top-k then softmax over the k logits (the default);
without renormalisation it is --moe-router-pre-softmax. HF's dense-layer rule ((i + 1) %
decoder_sparse_step == 0 and i not in mlp_only_layers) becomes an explicit
--moe-layer-freq list. DeepSeek-V3 has its own WeightMap (hf_mla.DeepSeekV3Weights).
"""

from __future__ import annotations

from typing import Optional

from megamoe.config import ModelConfig
from megamoe.model.hf_mapping import MIXTRAL, QWEN_NAMES, WeightMap
from megamoe.model.hf_mla import DEEPSEEK_V3


def _rope_theta(cfg: dict, default: float) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(rope.get("rope_theta", cfg.get("rope_theta", default)))


def moe_layer_pattern(cfg: dict) -> list[int]:
    """Qwen's rule: layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers (and there are experts)."""
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    return [int((i + 1) % step == 0 and i not in dense)
            for i in range(cfg["num_hidden_layers"])]


class HFFamily:
    """The Mixtral-style decoder (RMSNorm, RoPE, GQA, SwiGLU experts, no biases); the
    other families override what differs."""

    name = "mixtral"
    architecture = "MixtralForCausalLM"
    weights: WeightMap = MIXTRAL
    norm_topk_prob_default = True  # Mixtral always renormalises
    rope_theta_default = 1e6
    eps_default = 1e-5

    # ------------------------------------------------------------ config.json -> flags

    def config_error(self, cfg: dict) -> Optional[str]:
        """Why this config.json cannot become a megamoe model (None when it can)."""
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        checks = [
            (cfg.get("hidden_act", "silu") != "silu",
             f"hidden_act {cfg.get('hidden_act')!r} (megamoe has silu)"),
            (cfg.get("sliding_window") not in (None, 0) or cfg.get("use_sliding_window"),
             "sliding_window attention is not supported by megamoe"),
            (rope.get("rope_type", rope.get("type", "default")) != "default",
             f"rope_type {rope.get('rope_type', rope.get('type'))!r} is not supported"),
            (cfg.get("attention_bias", False),
             "attention_bias (q/k/v and output biases; megamoe has --add-qkv-bias only)"),
        ]
        return next((why for bad, why in checks if bad), None)

    def num_experts(self, cfg: dict) -> int:
        return cfg["num_local_experts"] if "num_local_experts" in cfg else cfg["num_experts"]

    def expert_ffn(self, cfg: dict) -> int:
        return cfg["intermediate_size"]

    def layer_pattern(self, cfg: dict) -> list[int]:
        return [1] * cfg["num_hidden_layers"]

    def flags(self, cfg: dict) -> list[str]:
        """pretrain_gpt.py model flags that build the same network as `cfg`."""
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        seq = min(cfg.get("max_position_embeddings", 4096), 4096)
        flags = [
            "--num-layers", cfg["num_hidden_layers"], "--hidden-size", hidden,
            "--ffn-hidden-size", cfg["intermediate_size"], "--num-attention-heads", heads,
            "--group-query-attention", "--num-query-groups",
            cfg.get("num_key_value_heads") or heads,
            "--kv-channels", cfg.get("head_dim") or hidden // heads,
            "--seq-length", seq,
            "--max-position-embeddings", cfg.get("max_position_embeddings", seq),
            "--position-embedding-type", "rope",
            "--rotary-base", _rope_theta(cfg, self.rope_theta_default),
            "--normalization", "RMSNorm",
            "--norm-epsilon", cfg.get("rms_norm_eps", self.eps_default),
            "--swiglu", "--disable-bias-linear", "--hidden-dropout", 0.0,
            "--attention-dropout", cfg.get("attention_dropout", 0.0),
            "--init-method-std", cfg.get("initializer_range", 0.02),
            "--num-experts", self.num_experts(cfg),
            "--moe-router-topk", cfg["num_experts_per_tok"],
            "--moe-ffn-hidden-size", self.expert_ffn(cfg), "--moe-grouped-gemm",
            "--moe-aux-loss-coeff", cfg.get("router_aux_loss_coef", 0.0),
        ]
        pattern = self.layer_pattern(cfg)
        if not all(pattern):
            flags += ["--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"]
        if not cfg.get("norm_topk_prob", self.norm_topk_prob_default):
            flags.append("--moe-router-pre-softmax")
        if not cfg.get("tie_word_embeddings", False):
            flags.append("--untie-embeddings-and-output-weights")
        return [str(f) for f in flags + self.extra_flags(cfg)]

    def extra_flags(self, cfg: dict) -> list:
        return []

    def config_for_weights(self, cfg: dict, keys) -> dict:
        """`cfg` as the weights at hand realise it (DeepSeek-V3: the MTP layers present)."""
        return cfg

    # ------------------------------------------------------------ megamoe -> config.json

    def export_error(self, config: ModelConfig) -> Optional[str]:
        """Why this megamoe model cannot be this family's model (None when it can)."""
        moe = config.moe
        if moe is None:
            return "a dense model (no --num-experts)"
        checks = [
            (config.normalization != "RMSNorm", "--normalization LayerNorm"),
            (config.position_embedding_type != "rope",
             "no rotary embedding (--position-embedding-type)"),
            (config.rotary_percent != 1.0, "--rotary-percent < 1"),
            (config.rotary_interleaved, "--rotary-interleaved (transformers rotates halves)"),
            (config.use_rope_scaling, "--use-rope-scaling (not mapped to rope_scaling yet)"),
            (not config.swiglu, "no --swiglu (transformers' families are SwiGLU MLPs)"),
            (config.add_bias_linear, "linear biases (no --disable-bias-linear)"),
            (moe.score_function != "softmax", "--moe-router-score-function sigmoid"),
            (moe.topk_scaling_factor not in (None, 1.0), "--moe-router-topk-scaling-factor"),
            (moe.num_groups is not None, "--moe-router-num-groups"),
            (moe.enable_expert_bias, "--moe-router-enable-expert-bias"),
            (config.multi_latent_attention, "--multi-latent-attention"),
            (bool(config.mtp_num_layers), "--mtp-num-layers"),
        ]
        return next((why for bad, why in checks if bad), None) or self.family_error(config)

    def family_error(self, config: ModelConfig) -> Optional[str]:
        moe = config.moe
        checks = [
            (not all(config.moe_layer_pattern),
             "dense layers between MoE layers (--moe-layer-freq)"),
            (config.qk_layernorm, "--qk-layernorm (Mixtral has no q/k norms)"),
            (config.add_qkv_bias, "--add-qkv-bias (Mixtral has no QKV bias)"),
            (moe.pre_softmax, "--moe-router-pre-softmax (Mixtral renormalises the top-k)"),
            (moe.shared_expert_intermediate_size is not None,
             "--moe-shared-expert-intermediate-size"),
        ]
        return next((why for bad, why in checks if bad), None)

    def config_fields(self, config: ModelConfig) -> dict:
        """config.json fields (transformers' names) of this family's model of `config`."""
        moe = config.moe
        return dict(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=moe.ffn_hidden_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.norm_epsilon,
            rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base},
            num_local_experts=moe.num_experts, num_experts_per_tok=moe.topk,
            router_aux_loss_coef=moe.aux_loss_coeff("aux_loss"),
            attention_dropout=config.attention_dropout, sliding_window=None,
            tie_word_embeddings=not config.untie_embeddings_and_output_weights,
            initializer_range=config.init_method_std)

    @property
    def model_type(self) -> str:
        return self.name


class Qwen3MoeFamily(HFFamily):
    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    weights = WeightMap(QWEN_NAMES)
    norm_topk_prob_default = False
    rope_theta_default = 10000.0
    eps_default = 1e-6

    def expert_ffn(self, cfg: dict) -> int:
        return cfg["moe_intermediate_size"]

    def layer_pattern(self, cfg: dict) -> list[int]:
        return moe_layer_pattern(cfg)

    def extra_flags(self, cfg: dict) -> list:
        return ["--qk-layernorm"]

    def family_error(self, config: ModelConfig) -> Optional[str]:
        checks = [
            (not config.qk_layernorm or config.qk_layernorm_scope != "head",
             "Qwen3-MoE has per-head q/k norms (--qk-layernorm, scope head)"),
            (config.add_qkv_bias, "--add-qkv-bias (Qwen3-MoE has no QKV bias)"),
            (config.moe.shared_expert_intermediate_size is not None,
             "--moe-shared-expert-intermediate-size (Qwen3-MoE has no shared expert)"),
        ]
        return next((why for bad, why in checks if bad), None)

    def config_fields(self, config: ModelConfig) -> dict:
        fields = _qwen_fields(super().config_fields(config), config)
        return {**fields, "attention_bias": False}


class Qwen2MoeFamily(Qwen3MoeFamily):
    name = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"

    def config_error(self, cfg: dict) -> Optional[str]:
        if not cfg.get("shared_expert_intermediate_size"):
            return "no shared_expert_intermediate_size (Qwen2-MoE has a gated shared expert)"
        return super().config_error(cfg)

    def extra_flags(self, cfg: dict) -> list:
        flags = ["--moe-shared-expert-intermediate-size",
                 cfg["shared_expert_intermediate_size"], "--moe-shared-expert-gate"]
        return flags + (["--add-qkv-bias"] if cfg.get("qkv_bias", True) else [])

    def family_error(self, config: ModelConfig) -> Optional[str]:
        moe = config.moe
        checks = [
            (config.qk_layernorm, "--qk-layernorm (Qwen2-MoE has no q/k norms)"),
            (moe.shared_expert_intermediate_size is None or not moe.shared_expert_gate,
             "Qwen2-MoE has a gated shared expert (--moe-shared-expert-intermediate-size "
             "and --moe-shared-expert-gate)"),
            (config.kv_channels * config.num_attention_heads != config.hidden_size,
             "--kv-channels other than hidden / heads (Qwen2-MoE has no head_dim)"),
        ]
        return next((why for bad, why in checks if bad), None)

    def config_fields(self, config: ModelConfig) -> dict:
        fields = _qwen_fields(HFFamily.config_fields(self, config), config)
        fields.pop("head_dim")
        return {**fields, "qkv_bias": config.add_qkv_bias,
                "shared_expert_intermediate_size": config.moe.shared_expert_intermediate_size}


def _qwen_fields(fields: dict, config: ModelConfig) -> dict:
    """Qwen's names: experts' size apart from the dense layers', dense layers listed."""
    moe = config.moe
    fields.pop("num_local_experts")
    return {**fields, "num_experts": moe.num_experts, "moe_intermediate_size":
            moe.ffn_hidden_size, "intermediate_size": config.ffn_hidden_size,
            "decoder_sparse_step": 1, "norm_topk_prob": not moe.pre_softmax,
            "mlp_only_layers": [i for i, m in enumerate(config.moe_layer_pattern) if not m],
            "use_sliding_window": False}


class OlmoeFamily(HFFamily):
    name = "olmoe"
    architecture = "OlmoeForCausalLM"
    weights = WeightMap(QWEN_NAMES)
    norm_topk_prob_default = False
    rope_theta_default = 10000.0

    def config_error(self, cfg: dict) -> Optional[str]:
        heads = cfg["num_attention_heads"]
        if cfg.get("clip_qkv") is not None:
            return "clip_qkv (clipping q/k/v is not supported by megamoe)"
        if cfg.get("head_dim") not in (None, cfg["hidden_size"] // heads):
            return "head_dim other than hidden_size / num_attention_heads"
        return super().config_error(cfg)

    def extra_flags(self, cfg: dict) -> list:
        return ["--qk-layernorm", "--qk-layernorm-scope", "projection"]

    def family_error(self, config: ModelConfig) -> Optional[str]:
        moe = config.moe
        checks = [
            (not all(config.moe_layer_pattern), "dense layers (OLMoE has MoE layers only)"),
            (not config.qk_layernorm or config.qk_layernorm_scope != "projection",
             "OLMoE normalises the whole q/k projections (--qk-layernorm-scope projection)"),
            (config.add_qkv_bias, "--add-qkv-bias (OLMoE has no QKV bias)"),
            (moe.shared_expert_intermediate_size is not None,
             "--moe-shared-expert-intermediate-size (OLMoE has no shared expert)"),
            (config.kv_channels * config.num_attention_heads != config.hidden_size,
             "--kv-channels other than hidden / heads (OLMoE's q norm spans hidden_size)"),
        ]
        return next((why for bad, why in checks if bad), None)

    def config_fields(self, config: ModelConfig) -> dict:
        fields = super().config_fields(config)
        fields.pop("num_local_experts"), fields.pop("sliding_window"), fields.pop("head_dim")
        return {**fields, "num_experts": config.moe.num_experts, "clip_qkv": None,
                "attention_bias": False, "norm_topk_prob": not config.moe.pre_softmax,
                "pad_token_id": None, "eos_token_id": None}


class DeepSeekV3Family(HFFamily):
    """DeepSeek-V3: multi-latent attention with YaRN, first_k_dense_replace dense layers,
    sigmoid routing limited to topk_group of n_group groups, normalised and scaled by
    routed_scaling_factor, the aux-loss-free correction bias (--moe-router-enable-expert-
    bias), shared experts without a gate, and num_nextn_predict_layers MTP depths.
    Megatron scores a group by its top (topk / group_topk) experts, transformers by its
    top 2: configs where those differ are refused (DeepSeek-V3: 8 / 4 = 2)."""

    name = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    weights = DEEPSEEK_V3

    def config_error(self, cfg: dict) -> Optional[str]:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        yarn_fixed = {"original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1}
        groups = cfg.get("n_group") or 1
        checks = [
            (cfg.get("hidden_act", "silu") != "silu", "hidden_act other than silu"),
            (cfg.get("attention_bias", False), "attention_bias (MLA has no biases)"),
            (kind not in ("default", "yarn"), f"rope_type {kind!r} is not supported"),
            (kind == "yarn" and any(rope.get(k, v) != v for k, v in yarn_fixed.items()),
             f"YaRN constants other than {yarn_fixed} (megamoe has no flags for them)"),
            (cfg.get("scoring_func", "sigmoid") != "sigmoid", "scoring_func other than "
             "sigmoid"),
            (not cfg.get("norm_topk_prob", True), "norm_topk_prob false (Megatron's sigmoid "
             "routing always normalises the top-k)"),
            (groups > 1 and cfg["num_experts_per_tok"] != 2 * cfg["topk_group"],
             "num_experts_per_tok != 2 x topk_group (transformers scores a group by its top "
             "2 experts, Megatron by its top num_experts_per_tok / topk_group)"),
            (cfg.get("moe_layer_freq", 1) != 1, "moe_layer_freq other than 1"),
            (not cfg.get("n_shared_experts"), "no shared experts (n_shared_experts)"),
        ]
        return next((why for bad, why in checks if bad), None)

    def num_experts(self, cfg: dict) -> int:
        return cfg["n_routed_experts"]

    def config_for_weights(self, cfg: dict, keys) -> dict:
        """The MTP depths are the MTP layers the files hold: DeepSeek's own checkpoints
        carry num_nextn_predict_layers of them, transformers saves none (and keeps the
        field), so a model saved by transformers converts without MTP."""
        n, keys = cfg["num_hidden_layers"], set(keys)
        depths = 0
        while (depths < cfg.get("num_nextn_predict_layers", 0)
               and f"model.layers.{n + depths}.eh_proj.weight" in keys):
            depths += 1
        return {**cfg, "num_nextn_predict_layers": depths}

    def expert_ffn(self, cfg: dict) -> int:
        return cfg["moe_intermediate_size"]

    def layer_pattern(self, cfg: dict) -> list[int]:
        k = cfg.get("first_k_dense_replace", 0)
        return [int(i >= k) for i in range(cfg["num_hidden_layers"])]

    def flags(self, cfg: dict) -> list[str]:
        base = super().flags(cfg)
        gqa = base.index("--group-query-attention")
        del base[gqa:gqa + 3]  # MLA: every head its own (latent) keys
        kv = base.index("--kv-channels")
        del base[kv:kv + 2]
        return base

    def extra_flags(self, cfg: dict) -> list:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        flags = ["--multi-latent-attention", "--qk-layernorm",
                 "--kv-lora-rank", cfg["kv_lora_rank"],
                 "--qk-head-dim", cfg["qk_nope_head_dim"],
                 "--qk-pos-emb-head-dim", cfg["qk_rope_head_dim"],
                 "--v-head-dim", cfg["v_head_dim"],
                 "--moe-shared-expert-intermediate-size",
                 cfg["n_shared_experts"] * cfg["moe_intermediate_size"],
                 "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-topk-scaling-factor", cfg.get("routed_scaling_factor", 1.0)]
        if cfg.get("q_lora_rank") is not None:
            flags += ["--q-lora-rank", cfg["q_lora_rank"]]
        if rope.get("rope_type", rope.get("type")) == "yarn":
            flags += ["--rotary-scaling-factor", rope["factor"],
                      "--mscale", rope.get("mscale", 1.0),
                      "--mscale-all-dim", rope.get("mscale_all_dim", 0.0)]
        else:
            flags += ["--rope-type", "rope"]
        if (cfg.get("n_group") or 1) > 1:
            flags += ["--moe-router-num-groups", cfg["n_group"],
                      "--moe-router-group-topk", cfg["topk_group"]]
        if cfg.get("num_nextn_predict_layers"):
            flags += ["--mtp-num-layers", cfg["num_nextn_predict_layers"]]
        return flags

    def export_error(self, config: ModelConfig) -> Optional[str]:
        moe = config.moe
        if moe is None or not config.multi_latent_attention:
            return "not a multi-latent-attention MoE model (--multi-latent-attention)"
        k = config.moe_layer_pattern.index(1) if 1 in config.moe_layer_pattern else 0
        checks = [
            (config.normalization != "RMSNorm", "--normalization LayerNorm"),
            (not config.swiglu or config.add_bias_linear, "no --swiglu, or linear biases"),
            (not config.qk_layernorm, "no latent norms (--qk-layernorm)"),
            (config.rotary_percent != 1.0, "--rotary-percent < 1"),
            (config.moe_layer_pattern != [0] * k + [1] * (config.num_layers - k),
             "dense layers after the first MoE layer"),
            (moe.score_function != "sigmoid" or not moe.enable_expert_bias,
             "DeepSeek-V3 routes by sigmoid scores with the expert bias"),
            (moe.shared_expert_intermediate_size is None or moe.shared_expert_gate,
             "DeepSeek-V3 has ungated shared experts"),
            (moe.shared_expert_intermediate_size is not None
             and moe.shared_expert_intermediate_size % moe.ffn_hidden_size,
             "a shared expert size that is not a multiple of --moe-ffn-hidden-size"),
            (moe.num_groups is not None and moe.topk != 2 * moe.group_topk,
             "--moe-router-topk != 2 x --moe-router-group-topk"),
        ]
        return next((why for bad, why in checks if bad), None)

    def config_fields(self, config: ModelConfig) -> dict:
        moe, c = config.moe, config
        k = c.moe_layer_pattern.index(1)
        rope = ({"rope_type": "yarn", "rope_theta": c.rotary_base,
                 "factor": c.rotary_scaling_factor, "mscale": c.mscale,
                 "mscale_all_dim": c.mscale_all_dim,
                 "original_max_position_embeddings": c.original_max_position_embeddings,
                 "beta_fast": c.beta_fast, "beta_slow": c.beta_slow}
                if c.mla_rope_type == "yarn" else
                {"rope_type": "default", "rope_theta": c.rotary_base})
        return dict(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.ffn_hidden_size, moe_intermediate_size=moe.ffn_hidden_size,
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_attention_heads,
            n_shared_experts=moe.shared_expert_intermediate_size // moe.ffn_hidden_size,
            n_routed_experts=moe.num_experts, num_experts_per_tok=moe.topk,
            routed_scaling_factor=moe.topk_scaling_factor or 1.0,
            kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
            qk_rope_head_dim=c.qk_pos_emb_head_dim, qk_nope_head_dim=c.qk_head_dim,
            v_head_dim=c.v_head_dim, n_group=moe.num_groups or 1,
            topk_group=moe.group_topk or 1, first_k_dense_replace=k, norm_topk_prob=True,
            max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_epsilon,
            rope_parameters=rope, attention_bias=False,
            attention_dropout=c.attention_dropout,
            tie_word_embeddings=not c.untie_embeddings_and_output_weights,
            initializer_range=c.init_method_std,
            num_nextn_predict_layers=c.mtp_num_layers or 0)


FAMILIES: dict[str, HFFamily] = {f.name: f for f in (
    HFFamily(), Qwen2MoeFamily(), Qwen3MoeFamily(), OlmoeFamily(), DeepSeekV3Family())}
_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}


def family_of_config(cfg: dict) -> HFFamily:
    """The family of a config.json (its `architectures`, else its `model_type`);
    KeyError naming what was found when megamoe has no such family."""
    for arch in cfg.get("architectures") or []:
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    if cfg.get("model_type") in FAMILIES:
        return FAMILIES[cfg["model_type"]]
    raise KeyError(f"model_type {cfg.get('model_type')!r} / architectures "
                   f"{cfg.get('architectures')} is not one of megamoe's families "
                   f"({', '.join(f.architecture for f in FAMILIES.values())})")


def family_of_model(config: ModelConfig) -> HFFamily:
    """The one family a megamoe model fits (the families are disjoint: Mixtral has no q/k
    norm, shared expert or dense layers; Qwen2-MoE a gated shared expert; Qwen3-MoE
    per-head and OLMoE whole-projection q/k norms); ValueError with each family's reason
    when none fits."""
    reasons = []
    for family in FAMILIES.values():
        why = family.export_error(config)
        if why is None:
            return family
        reasons.append(f"{family.architecture}: {why}")
    raise ValueError("; ".join(reasons))
