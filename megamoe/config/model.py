"""The GPT decoder's shape and options (Megatron names, minus the `--`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megamoe.config.fields import (
    ConfigError,
    check_positive,
    check_range,
    derived,
    flag,
    known_fields,
    require,
)
from megamoe.config.moe import MoEConfig

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
QK_LAYERNORM_SCOPES = ("head", "projection")
# MLA's fields and flags: given without --multi-latent-attention, they are an error.
MLA_FLAGS = (("q_lora_rank", "--q-lora-rank"), ("kv_lora_rank", "--kv-lora-rank"),
             ("qk_head_dim", "--qk-head-dim"), ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim"),
             ("v_head_dim", "--v-head-dim"), ("rotary_scaling_factor", "--rotary-scaling-factor"),
             ("mscale", "--mscale"), ("mscale_all_dim", "--mscale-all-dim"))
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


# Per-layer lists, modules and counts are built from --num-layers: past this (1000x the
# deepest MoE model published) a typo would allocate without bound instead of failing.
MAX_LAYERS = 2**16


def check_layer_counts(num_layers: Optional[int], mtp_num_layers: Optional[int]) -> None:
    for name, value in (("--num-layers", num_layers), ("--mtp-num-layers", mtp_num_layers)):
        if value is not None and value > MAX_LAYERS:
            raise ConfigError(f"{name} must be at most {MAX_LAYERS}, got {value}")


@dataclass
class ModelConfig:
    """GPT decoder shape and options; what a checkpoint stores to rebuild its model."""

    num_layers: int = flag("--num-layers", 2)
    hidden_size: int = flag("--hidden-size", 128)
    ffn_hidden_size: int = flag("--ffn-hidden-size", 512)
    num_attention_heads: int = flag("--num-attention-heads", 4)
    num_query_groups: Optional[int] = flag("--num-query-groups", None)  # None = MHA
    kv_channels: Optional[int] = flag("--kv-channels", None)  # head dim; None = H / heads
    seq_length: int = flag("--seq-length", 128)
    max_position_embeddings: int = flag("--max-position-embeddings", 128)
    vocab_size: int = derived("the tokenizer's vocabulary size", 512)
    make_vocab_size_divisible_by: int = flag("--make-vocab-size-divisible-by", 128)
    # Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP
    # (vocab_size_with_padding). Checkpoints written before this field existed padded to
    # the divisor alone: their dicts lack it, so from_dict's default 1 rebuilds them as saved.
    vocab_padding_tp: int = derived("--tensor-model-parallel-size (Megatron's padding rule)", 1)
    # --padded-vocab-size (Megatron's TokenizerConfig.padded_vocab_size): the embedding rows,
    # fixed instead of computed; at least the vocabulary and divisible by TP (run.py).
    fixed_padded_vocab_size: Optional[int] = flag("--padded-vocab-size", None)
    # Set when a resumed run keeps its checkpoint's padded size (training/vocab_padding.py).
    padded_vocab_size_from_checkpoint: Optional[int] = derived(
        "the --load checkpoint's embedding rows, when this run's padding differs", None)
    normalization: str = flag("--normalization", "LayerNorm")
    norm_epsilon: float = flag("--norm-epsilon", 1e-5)
    position_embedding_type: str = flag("--position-embedding-type", "learned_absolute")
    rotary_base: float = flag("--rotary-base", 10000.0)
    rotary_percent: float = flag("--rotary-percent", 1.0)
    swiglu: bool = flag("--swiglu", False)
    # Megatron's other MLP activations (argument_utils.py): --squared-relu is relu(x)^2 on
    # a plain fc1; --quick-geglu a gated fc1 ([gate; up], as --swiglu) with
    # quick_gelu(gate) * up, quick_gelu(x) = x * sigmoid(1.702 x). Neither with --swiglu.
    squared_relu: bool = flag("--squared-relu", False)
    quick_geglu: bool = flag("--quick-geglu", False)
    # Megatron's --rotary-interleaved: RoPE rotates the channel pairs (x0, x1), (x2, x3), ...
    # (GPT-J / Meta Llama order) instead of the two halves; standard attention only.
    rotary_interleaved: bool = flag("--rotary-interleaved", False)
    # Megatron's --use-rope-scaling: Llama 3.x's frequency scaling of standard attention's
    # RoPE (RotaryEmbedding._apply_scaling: --rope-scaling-factor, low/high frequency
    # factors 1 and 4, original context 8192, none of them flags).
    use_rope_scaling: bool = flag("--use-rope-scaling", False)
    rope_scaling_factor: float = flag("--rope-scaling-factor", 8.0)
    add_bias_linear: bool = flag("--disable-bias-linear", True, dest="add_bias_linear")
    # Megatron's bias_gelu_fusion (--no-bias-gelu-fusion turns it off): a GELU MLP with
    # biases then runs the fused bias_gelu_impl, the tanh approximation of GELU, in the
    # dense MLP, shared experts and routed experts (see `activation`).
    bias_gelu_fusion: bool = flag("--no-bias-gelu-fusion", True, dest="bias_gelu_fusion")
    untie_embeddings_and_output_weights: bool = flag(
        "--untie-embeddings-and-output-weights", False)
    hidden_dropout: float = flag("--hidden-dropout", 0.1)
    attention_dropout: float = flag("--attention-dropout", 0.1)
    init_method_std: float = flag("--init-method-std", 0.02)
    # Attention through SDPA's flash-attention kernel only (Megatron: the flash-attn
    # package); SDPA raises when the inputs do not fit it, never silently falls back.
    use_flash_attn: bool = flag("--use-flash-attn", False)
    # Megatron's --attention-backend: which SDPA kernels may run (model/attention_backend.py).
    attention_backend: str = flag("--attention-backend", "auto")
    # Megatron's --transformer-impl: megamoe's own layers, or Transformer Engine's modules
    # computing with the same parameters (model/te/; docs/transformer-engine.md).
    transformer_impl: str = flag("--transformer-impl", "local")
    # Megatron's --qk-layernorm: one norm (--normalization) over each query and key head's
    # channels, weights shared by the heads, before RoPE (Qwen3-MoE, OLMo-2 style).
    qk_layernorm: bool = flag("--qk-layernorm", False)
    # megamoe's extension (not a Megatron flag): "projection" normalises the whole q and k
    # projections (Nq*D and Nkv*D channels, one weight per channel) instead of each head,
    # as OLMoE does; under TP the statistic is summed over the ranks' heads.
    qk_layernorm_scope: str = flag("--qk-layernorm-scope", "head")
    # Megatron's --add-qkv-bias: a bias in the QKV projection even without linear biases.
    add_qkv_bias: bool = flag("--add-qkv-bias", False)
    # Multi-latent attention (DeepSeek-V2/V3; Megatron's MLATransformerConfig, model/mla.py):
    # q (optionally through a --q-lora-rank latent) and k/v through a --kv-lora-rank latent;
    # heads have --qk-head-dim channels without position plus --qk-pos-emb-head-dim rotary
    # ones (a key part shared by the heads), values --v-head-dim. --qk-layernorm adds the
    # latent norms (Megatron's q_layernorm / kv_layernorm).
    multi_latent_attention: bool = flag("--multi-latent-attention", False)
    q_lora_rank: Optional[int] = flag("--q-lora-rank", None)  # None: no query compression
    kv_lora_rank: int = flag("--kv-lora-rank", 32)
    qk_head_dim: int = flag("--qk-head-dim", 128)
    qk_pos_emb_head_dim: int = flag("--qk-pos-emb-head-dim", 64)
    v_head_dim: int = flag("--v-head-dim", 128)
    # MLA's rotary embedding: None = "yarn" (Megatron's MLA default); "rope" = plain RoPE.
    rope_type: Optional[str] = flag("--rope-type", None)
    rotary_scaling_factor: float = flag("--rotary-scaling-factor", 1.0)  # YaRN factor
    mscale: float = flag("--mscale", 1.0)
    mscale_all_dim: float = flag("--mscale-all-dim", 0.0)
    # YaRN's other constants: Megatron's command line does not set them for MLA either.
    original_max_position_embeddings: int = derived(
        "Megatron's MLA default (no flag; a converted model may set it)", 4096)
    beta_fast: float = derived("Megatron's MLA default (no flag)", 32.0)
    beta_slow: float = derived("Megatron's MLA default (no flag)", 1.0)
    # Multi-token prediction (DeepSeek-V3, Megatron's flags): D = --mtp-num-layers extra
    # modules after the decoder, module k predicting token i + 1 + k (model/mtp.py); their
    # mean loss x --mtp-loss-scaling-factor joins the LM loss in the gradient only.
    mtp_num_layers: Optional[int] = flag("--mtp-num-layers", None)  # None = no MTP
    mtp_loss_scaling_factor: float = flag("--mtp-loss-scaling-factor", 0.1)
    # MoE: layer i is an MoE layer when moe is set and moe_layer_pattern[i] == 1.
    moe: Optional[MoEConfig] = derived("--num-experts and the other --moe-* flags", None)
    moe_layer_pattern: Optional[list[int]] = derived("--moe-layer-freq", None)

    def __post_init__(self) -> None:
        check_layer_counts(self.num_layers, self.mtp_num_layers)  # before any per-layer list
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.moe is not None and self.moe_layer_pattern is None:
            self.moe_layer_pattern = [1] * self.num_layers
        self.validate()

    def validate(self) -> None:
        check_positive(self, "num_layers", "hidden_size", "num_attention_heads",
                       "ffn_hidden_size", "seq_length", "num_query_groups", "kv_channels",
                       "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings",
                       "vocab_padding_tp", "padded_vocab_size_from_checkpoint",
                       "fixed_padded_vocab_size")
        require(self.fixed_padded_vocab_size is None
                or self.fixed_padded_vocab_size >= self.vocab_size,
                f"--padded-vocab-size {self.fixed_padded_vocab_size} is smaller than the "
                f"tokenizer's vocabulary ({self.vocab_size})")
        require(self.padded_vocab_size >= self.vocab_size,
                f"padded vocabulary {self.padded_vocab_size} < vocabulary {self.vocab_size}")
        check_positive(self, "mtp_num_layers")
        check_range(self, "mtp_loss_scaling_factor", 0)
        require(self.attention_backend in ATTENTION_BACKENDS, f"--attention-backend must be "
                f"one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        check_range(self, "rotary_base", 0, low_open=True)
        check_range(self, "rotary_percent", 0, 1, low_open=True, high_open=False)
        check_range(self, "norm_epsilon", 0)
        check_range(self, "init_method_std", 0)
        check_range(self, "hidden_dropout", 0, 1)
        check_range(self, "attention_dropout", 0, 1)
        require(self.hidden_size % self.num_attention_heads == 0,
                f"--hidden-size ({self.hidden_size}) must be divisible by "
                f"--num-attention-heads ({self.num_attention_heads})")
        require(self.num_attention_heads % self.num_query_groups == 0,
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({self.num_query_groups})")
        require(self.transformer_impl in ("local", "transformer_engine"),
                "--transformer-impl must be local or transformer_engine, got "
                f"{self.transformer_impl!r}")
        require(self.normalization in NORMALIZATIONS,
                f"--normalization must be one of {', '.join(NORMALIZATIONS)}, "
                f"got {self.normalization!r}")
        require(self.position_embedding_type in POSITION_EMBEDDING_TYPES,
                f"--position-embedding-type must be one of "
                f"{', '.join(POSITION_EMBEDDING_TYPES)}, got {self.position_embedding_type!r}")
        # Megatron refuses this for every position embedding type (RoPE included).
        require(self.seq_length <= self.max_position_embeddings,
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.max_position_embeddings})")
        self._validate_qk_layernorm()
        self._validate_activation()
        if self.position_embedding_type == "rope":
            dim = int(self.kv_channels * self.rotary_percent)
            require(dim > 0 and dim % 2 == 0,
                    f"rotary dim {dim} (--kv-channels {self.kv_channels} x --rotary-percent "
                    f"{self.rotary_percent}) must be positive and even")
        self._validate_mla()
        if self.moe_layer_pattern is not None:
            require(len(self.moe_layer_pattern) == self.num_layers,
                    f"--moe-layer-freq pattern has {len(self.moe_layer_pattern)} entries "
                    f"but --num-layers is {self.num_layers}")

    def _validate_activation(self) -> None:
        """Megatron asserts that --squared-relu and --quick-geglu come without --swiglu;
        given together, Megatron takes --squared-relu and drops --quick-geglu silently:
        refused here instead (a flag would be ignored). --rotary-interleaved: Megatron's
        TransformerConfig refuses it with MLA (whose pairs are its own)."""
        chosen = [f for f, on in (("--swiglu", self.swiglu), ("--squared-relu",
                  self.squared_relu), ("--quick-geglu", self.quick_geglu)) if on]
        require(len(chosen) <= 1, f"{' and '.join(chosen)} cannot be combined (one MLP "
                "activation)")
        require(not (self.rotary_interleaved and self.multi_latent_attention),
                "--rotary-interleaved cannot be combined with --multi-latent-attention")
        check_range(self, "rope_scaling_factor", 0, low_open=True)
        require(self.use_rope_scaling or self.rope_scaling_factor == 8.0,
                "--rope-scaling-factor needs --use-rope-scaling")
        require(not self.use_rope_scaling or (self.position_embedding_type == "rope"
                                              and not self.multi_latent_attention),
                "--use-rope-scaling needs --position-embedding-type rope (standard "
                "attention: MLA has its own YaRN scaling)")

    @property
    def activation(self) -> str:
        """The MLP activation: gelu, gelu_tanh, swiglu, squared_relu or quick_geglu.

        Megatron-LM: validate_args turns bias_gelu_fusion off without linear biases, and
        core_transformer_config_from_args makes it bias_activation_fusion (no --swiglu);
        megatron-core's MLP then runs bias_gelu_impl, tanh GELU, for F.gelu and erf GELU
        (F.gelu) otherwise."""
        if self.swiglu or self.squared_relu or self.quick_geglu:
            return ("swiglu" if self.swiglu else "squared_relu" if self.squared_relu
                    else "quick_geglu")
        return "gelu_tanh" if self.add_bias_linear and self.bias_gelu_fusion else "gelu"

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 computes [gate; up] (2F outputs): --swiglu and --quick-geglu."""
        return self.swiglu or self.quick_geglu

    def _validate_qk_layernorm(self) -> None:
        require(self.qk_layernorm_scope in QK_LAYERNORM_SCOPES,
                f"--qk-layernorm-scope must be one of {', '.join(QK_LAYERNORM_SCOPES)}, "
                f"got {self.qk_layernorm_scope!r}")
        if self.qk_layernorm_scope == "projection":
            require(self.qk_layernorm,
                    "--qk-layernorm-scope projection needs --qk-layernorm")
            require(self.normalization == "RMSNorm",
                    "not supported yet: --qk-layernorm-scope projection with "
                    "--normalization LayerNorm (OLMoE's whole-projection norm is an RMSNorm)")
            require(not self.multi_latent_attention,
                    "--qk-layernorm-scope projection cannot be combined with "
                    "--multi-latent-attention (its --qk-layernorm norms the latents)")

    def _validate_mla(self) -> None:
        """MLA's own flags need --multi-latent-attention (Megatron ignores them silently);
        with it, its dimensions must be positive and GQA / --add-qkv-bias are refused (MLA
        has one latent shared by all heads and no QKV bias, as Megatron)."""
        require(self.rope_type in (None, "rope", "yarn"),
                f"--rope-type must be rope or yarn, got {self.rope_type!r}")
        if not self.multi_latent_attention:
            for name, flag_name in MLA_FLAGS:
                require(getattr(self, name) == _DEFAULTS[name],
                        f"{flag_name} needs --multi-latent-attention")
            require(self.rope_type != "yarn", "--rope-type yarn needs "
                    "--multi-latent-attention (common attention takes rope only, as Megatron)")
            return
        check_positive(self, "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                       "qk_pos_emb_head_dim", "v_head_dim", "original_max_position_embeddings")
        check_range(self, "rotary_scaling_factor", 0, low_open=True)
        check_range(self, "mscale", 0)
        check_range(self, "mscale_all_dim", 0)
        require(self.num_query_groups == self.num_attention_heads,
                "--multi-latent-attention cannot be combined with --group-query-attention")
        require(not self.add_qkv_bias,
                "--add-qkv-bias cannot be combined with --multi-latent-attention")
        dim = self.mla_rotary_dim
        require(dim > 0 and dim % 2 == 0,
                f"MLA rotary dim {dim} (--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim}) "
                "must be positive and even")

    @property
    def mla_rope_type(self) -> str:
        """The rotary embedding MLA applies (yarn unless --rope-type rope)."""
        return self.rope_type or "yarn"

    @property
    def mla_rotary_dim(self) -> int:
        """Rotated channels of MLA's position part (rope: x --rotary-percent, as Megatron)."""
        if self.mla_rope_type == "rope":
            return int(self.qk_pos_emb_head_dim * self.rotary_percent)
        return self.qk_pos_emb_head_dim

    @property
    def padded_vocab_size(self) -> int:
        """Megatron's vocab_size_with_padding: the vocabulary rounded up to a multiple of
        --make-vocab-size-divisible-by x TP (so every TP rank's slice is a multiple of the
        divisor), unless --padded-vocab-size fixes it or a resumed checkpoint's padded size
        is kept.

        The extra rows are masked out of the softmax, so padding never changes the loss.
        """
        if self.fixed_padded_vocab_size is not None:
            return self.fixed_padded_vocab_size
        if self.padded_vocab_size_from_checkpoint is not None:
            return self.padded_vocab_size_from_checkpoint
        m = self.make_vocab_size_divisible_by * self.vocab_padding_tp
        return ((self.vocab_size + m - 1) // m) * m

    def is_moe_layer(self, layer_number: int) -> bool:
        """Layer `layer_number` (0-based) has an MoE MLP. MTP layers (numbered after the
        decoder's, num_layers + k) are of the last decoder layer's kind, as Megatron builds
        them from the decoder's last layer spec."""
        if layer_number >= self.num_layers:
            layer_number = self.num_layers - 1
        return self.moe is not None and bool(self.moe_layer_pattern[layer_number])

    @property
    def num_mtp_layers(self) -> int:
        """--mtp-num-layers, 0 without MTP."""
        return self.mtp_num_layers or 0

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """The inverse of to_dict (derived fields are recomputed). Accepts the dicts of
        older checkpoints too: unknown keys (such as the MoE execution settings they kept
        inside "moe") are ignored."""
        fields = known_fields(cls, d)
        moe = fields.pop("moe", None)
        return cls(**fields, moe=MoEConfig(**known_fields(MoEConfig, moe)) if moe else None)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
