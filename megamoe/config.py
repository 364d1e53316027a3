"""Small per-feature config dataclasses.

`megamoe.cli.arguments` turns Megatron-LM command-line flags into these; library users can
build them directly. Each class holds only what its feature reads, so a layer never
receives the whole argument namespace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class MoEConfig:
    """What one MoE layer needs: routing, balancing losses, capacity and experts."""

    num_experts: int = 8
    topk: int = 2
    ffn_hidden_size: int = 2048  # per-expert intermediate size (--moe-ffn-hidden-size)
    # Router.
    score_function: str = "softmax"  # softmax | sigmoid
    pre_softmax: bool = False
    topk_scaling_factor: Optional[float] = None
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    router_dtype: str = "fp32"  # fp32 | fp64
    router_type: str = "topk"  # topk (token choice) | expert_choice (Python API)
    input_jitter_eps: Optional[float] = None
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    # Load balancing: parallel lists, one coefficient per type.
    load_balancing_types: list[str] = field(default_factory=lambda: ["aux_loss"])
    aux_loss_coeffs: list[float] = field(default_factory=lambda: [0.0])
    z_loss_coeff: Optional[float] = None
    # Capacity (None = dropless). > 0: fixed factor x fair share; Python API also Tutel's
    # 0 = largest needed load (no drops, padded), < 0 = min(needed, |cf| x fair share).
    capacity_factor: Optional[float] = None
    pad_to_capacity: bool = False
    token_drop_policy: str = "probs"  # probs | position
    # Experts and dispatch.
    grouped_gemm: bool = False
    token_dispatcher_type: str = "allgather"
    a2a_overlap_degree: int = 1  # alltoall chunks pipelined with the expert GEMMs
    adaptive_parallelism: bool = False  # ep / dp / tp per call by cost (moe/adaptive.py)
    shared_expert_intermediate_size: Optional[int] = None
    shared_expert_gate: bool = False
    per_layer_logging: bool = False
    use_upcycling: bool = False  # experts start as copies of the dense MLP (--moe-use-upcycling)

    def aux_loss_coeff(self, kind: str) -> float:
        """Coefficient of balancing loss `kind`, 0.0 when that type is not enabled."""
        return sum(c for t, c in zip(self.load_balancing_types, self.aux_loss_coeffs) if t == kind)


@dataclass
class ModelConfig:
    """GPT decoder shape and options (Megatron names, minus the `--`)."""

    num_layers: int = 2
    hidden_size: int = 128
    ffn_hidden_size: int = 512
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None = multi-head attention
    kv_channels: Optional[int] = None  # head dim; None = hidden / heads
    seq_length: int = 128
    max_position_embeddings: int = 128
    vocab_size: int = 512  # real tokenizer vocabulary
    make_vocab_size_divisible_by: int = 128
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    norm_epsilon: float = 1e-5
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | none
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    swiglu: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # MoE: layer i is an MoE layer when moe is set and moe_layer_pattern[i] == 1.
    moe: Optional[MoEConfig] = None
    moe_layer_pattern: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.moe is not None and self.moe_layer_pattern is None:
            self.moe_layer_pattern = [1] * self.num_layers

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up for GEMM-friendly shapes; never depends on the layout.

        The extra rows are masked out of the softmax, so padding never changes the loss.
        """
        m = self.make_vocab_size_divisible_by
        return ((self.vocab_size + m - 1) // m) * m

    def is_moe_layer(self, layer_number: int) -> bool:
        return self.moe is not None and bool(self.moe_layer_pattern[layer_number])


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # None = TP
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    world_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None

    @property
    def data_parallel_size(self) -> int:
        model = (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )
        return self.world_size // model


@dataclass
class DataConfig:
    data_path: Optional[list[str]] = None  # Megatron style: [w1, p1, w2, p2] or [p1, p2]
    train_data_path: Optional[list[str]] = None
    valid_data_path: Optional[list[str]] = None
    test_data_path: Optional[list[str]] = None
    split: str = "969,30,1"
    mock_data: bool = False
    data_cache_path: Optional[str] = None
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None  # for NullTokenizer
    seq_length: int = 128
    num_workers: int = 0
    seed: int = 1234
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    # LR schedule.
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_init: float = 0.0
    lr_decay_iters: Optional[int] = None
    lr_decay_style: str = "linear"  # constant | linear | cosine | inverse-square-root | WSD
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_style: str = "exponential"


@dataclass
class TrainConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 1
    train_iters: int = 10
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 10
    skip_train: bool = False
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    # Checkpointing (single process here; distributed checkpoints are their own feature).
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    finetune: bool = False
    async_save: bool = False
    ckpt_keep_last: Optional[int] = None  # None = keep every checkpoint
    ckpt_format: str = "torch_dist"  # or "torch" (single file); loading detects the format
    # Logging.
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    tensorboard_log_interval: int = 1
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    log_throughput: bool = False
    peak_tflops: Optional[float] = None  # per device, for MFU; None = measure a matmul
    timing_log_level: int = 0


def to_dict(obj) -> dict:
    """Dataclass (nested) -> plain dict, for checkpoints and logs."""
    return dataclasses.asdict(obj)


@dataclass
class RunConfig:
    """Everything pretrain_gpt.py needs, grouped by feature."""

    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    optim: OptimizerConfig
    train: TrainConfig
