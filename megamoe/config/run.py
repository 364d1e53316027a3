"""Everything one training run needs, grouped by feature, and the rules that span features
(a parallel layout must fit the model, the batch, the MoE settings and the checkpoint
format). Each part validates itself first; `RunConfig.validate` adds the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

from megamoe.config.data import DataConfig
from megamoe.config.fields import ConfigError, derived, require
from megamoe.config.fp8 import Fp8Config
from megamoe.config.model import ModelConfig
from megamoe.config.moe import MoEExecutionConfig, MoETrainingConfig
from megamoe.config.optim import OptimizerConfig
from megamoe.config.parallel import ParallelConfig
from megamoe.config.recompute import RecomputeConfig
from megamoe.config.train import CheckpointConfig, LoggingConfig, TrainConfig


@dataclass
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    moe_execution: MoEExecutionConfig = field(default_factory=MoEExecutionConfig)
    moe_training: MoETrainingConfig = field(default_factory=MoETrainingConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    # The flags as given (plain values), kept with checkpoints and sent to W&B.
    command_line: dict = derived("the command line", default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_microbatches(self) -> int:
        t = self.train
        return t.global_batch_size // (t.micro_batch_size * self.parallel.data_parallel_size)

    def validate(self) -> None:
        self._validate_tensor_parallel()
        self._validate_pipeline_and_batch()
        self._validate_schedule_units()
        if self.model.moe is not None:
            self._validate_moe()
        else:
            require(self.parallel.expert_model_parallel_size == 1,
                    "--expert-model-parallel-size > 1 needs --num-experts")
        self._validate_checkpoint()
        self._validate_recompute()
        moe = self.model.moe
        self.moe_execution.check_shared_expert_overlap(
            moe is not None and moe.shared_expert_intermediate_size is not None,
            "shared_experts" in self.recompute.selected)
        if self.model.mtp_num_layers:
            self._validate_mtp()
        if self.parallel.context_parallel_size > 1:
            self._validate_context_parallel()
        self._validate_attention_backend()
        if self.fp8.enabled:
            self._validate_fp8()
        # Megatron's get_megatron_optimizer: TE's FusedAdam runs on the distributed
        # optimizer's shards only
        require(not self.optim.use_precision_aware_optimizer
                or self.parallel.use_distributed_optimizer,
                "--use-precision-aware-optimizer only supported with --use-distributed-optimizer")

    def _validate_attention_backend(self) -> None:
        """Where the chosen SDPA kernels cannot run: flash takes no mask (the document
        mask of --reset-attention-mask); context parallelism runs its own attention op."""
        backend = self.model.attention_backend
        require(backend != "flash" or not self.data.reset_attention_mask,
                "--attention-backend flash cannot run the document mask of "
                "--reset-attention-mask (flash attention takes no mask): use fused, "
                "unfused or auto")
        require(backend == "auto" or self.parallel.context_parallel_size == 1,
                f"--attention-backend {backend} with --context-parallel-size > 1: the "
                "context-parallel attention op picks its kernels itself (use auto)")

    def _validate_mtp(self) -> None:
        """Under CP each depth's shifted-in tokens come from the head of the next chunk, so
        a chunk (S / (2 CP)) must hold at least D tokens. Not supported yet: a learned
        position table on a last pipeline stage that would need its own synchronised copy
        of it (RoPE models, as DeepSeek-V3, are fine)."""
        p, m = self.parallel, self.model
        chunk = m.seq_length // (2 * p.context_parallel_size)
        require(p.context_parallel_size == 1 or chunk >= m.mtp_num_layers,
                f"--mtp-num-layers {m.mtp_num_layers} must be at most --seq-length / "
                f"(2 x --context-parallel-size) ({chunk})")
        require(p.pipeline_model_parallel_size == 1
                or m.position_embedding_type != "learned_absolute",
                "not supported yet: --mtp-num-layers with --pipeline-model-parallel-size > 1 "
                "and --position-embedding-type learned_absolute")

    def _validate_context_parallel(self) -> None:
        """What context parallelism needs: each rank 2 equal chunks, split again by TP
        under SP; with a2a, heads (and K/V heads) per TP rank that split over the cp ranks
        (MLA's keys have a head per query head)."""
        p, m = self.parallel, self.model
        cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
        split = 2 * cp * (tp if p.sequence_parallel else 1)
        what = " x TP (sequence parallel)" if split > 2 * cp else ""
        require(m.seq_length % split == 0,
                f"--seq-length {m.seq_length} must be divisible by 2 x "
                f"--context-parallel-size{what} ({split})")
        if "a2a" in p.cp_comm_type:
            groups = m.num_attention_heads if m.multi_latent_attention else m.num_query_groups
            heads, groups = m.num_attention_heads // tp, groups // tp
            require(heads % cp == 0 and groups % cp == 0,
                    f"--cp-comm-type a2a needs the attention heads ({heads}) and key/value "
                    f"heads ({groups}) per tensor-parallel rank to be multiples of "
                    f"--context-parallel-size ({cp})")

    def _validate_tensor_parallel(self) -> None:
        """Every tensor-parallel split must be even (the padded vocabulary is a multiple of
        TP by construction, checked where a checkpoint's padded size is kept, and here for
        --padded-vocab-size: Megatron's VocabParallelEmbedding divides it by TP)."""
        tp = self.parallel.tensor_model_parallel_size
        if tp == 1:
            return
        m = self.model
        for name, value in (("--num-attention-heads", m.num_attention_heads),
                            ("--num-query-groups", m.num_query_groups),
                            ("--ffn-hidden-size", m.ffn_hidden_size),
                            ("--padded-vocab-size", m.fixed_padded_vocab_size or 0)):
            require(value % tp == 0,
                    f"{name} ({value}) must be divisible by --tensor-model-parallel-size ({tp})")
        require(not self.parallel.sequence_parallel or m.seq_length % tp == 0,
                f"--seq-length ({m.seq_length}) must be divisible by "
                f"--tensor-model-parallel-size ({tp}) with --sequence-parallel")

    def _validate_pipeline_and_batch(self) -> None:
        """Layers split over the (virtual) stages; interleaving needs the micro-batches in
        multiples of the pipeline size; the global batch splits into micro-batches."""
        p, t = self.parallel, self.train
        # raises on a bad split
        ranges = p.layer_ranges(self.model.num_layers, self.model.num_mtp_layers)
        interleaved = None
        if len(ranges[0]) > 1:
            interleaved = "--pipeline-model-parallel-layout with virtual stages" \
                if p.pipeline_model_parallel_layout is not None else \
                "--num-virtual-stages-per-pipeline-rank" \
                if p.num_virtual_stages_per_pipeline_rank is not None else \
                "--num-layers-per-virtual-pipeline-stage"
        dp = p.data_parallel_size
        final = "--step-batch-size-schedule: final global batch size" \
            if t.step_batch_size_schedule else "--global-batch-size"
        require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
                f"{final} ({t.global_batch_size}) must be divisible by "
                f"--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})")
        pp = p.pipeline_model_parallel_size
        require(interleaved is None or self.num_microbatches % pp == 0,
                f"{interleaved} needs the number of micro-batches "
                f"({self.num_microbatches}) to be divisible by --pipeline-model-parallel-size "
                f"({pp})")
        name = "--step-batch-size-schedule" if t.step_batch_size_schedule else \
            "--rampup-batch-size"
        for size in t.ramp_batch_sizes()[:-1]:  # Megatron checks each as the ramp reaches it
            require(size % (t.micro_batch_size * dp) == 0,
                    f"{name}: global batch size {size} of the ramp-up must be "
                    f"divisible by --micro-batch-size ({t.micro_batch_size}) x data-parallel "
                    f"size ({dp})")
            require(interleaved is None or size // (t.micro_batch_size * dp) % pp == 0,
                    f"{name}: global batch size {size} of the ramp-up gives "
                    f"{size // (t.micro_batch_size * dp)} micro-batches, not divisible by "
                    f"--pipeline-model-parallel-size ({pp}) as {interleaved} needs")

    def _validate_schedule_units(self) -> None:
        """As Megatron's validate_args: iteration-based training takes the LR schedule in
        iterations, sample-based training (--train-samples) in samples; --lr-warmup-fraction
        replaces the other warm-up flag. (Not checked with --skip-train: no schedule runs.)"""
        t, o = self.train, self.optim
        if t.skip_train:
            return
        by_samples = t.train_samples is not None
        given = {"--lr-decay-iters": o.lr_decay_iters is not None,
                 "--lr-warmup-iters": o.lr_warmup_iters != 0,
                 "--lr-wsd-decay-iters": o.lr_wsd_decay_iters is not None,
                 "--lr-decay-samples": o.lr_decay_samples is not None,
                 "--lr-warmup-samples": o.lr_warmup_samples != 0,
                 "--lr-wsd-decay-samples": o.lr_wsd_decay_samples is not None}
        for name, is_set in given.items():
            if is_set and name.endswith("-iters") and by_samples:
                raise ConfigError(f"{name} is for iteration-based training: with "
                                  f"--train-samples use {name[:-6]}-samples")
            if is_set and name.endswith("-samples") and not by_samples:
                raise ConfigError(f"{name} needs --train-samples (iteration-based training "
                                  f"uses {name[:-8]}-iters)")
        warmup = "--lr-warmup-samples" if by_samples else "--lr-warmup-iters"
        require(o.lr_warmup_fraction is None or not given[warmup],
                f"--lr-warmup-fraction and {warmup} are mutually exclusive")

    def _validate_moe(self) -> None:
        moe, p, exe = self.model.moe, self.parallel, self.moe_execution
        tp, ep, etp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.etp
        require(moe.num_experts % ep == 0,
                f"--num-experts ({moe.num_experts}) must be divisible by "
                f"--expert-model-parallel-size ({ep})")
        require(tp == 1 or p.sequence_parallel,
                "MoE with --tensor-model-parallel-size > 1 requires --sequence-parallel")
        require(etp == 1 or moe.ffn_hidden_size % etp == 0,
                f"--moe-ffn-hidden-size ({moe.ffn_hidden_size}) must be divisible by "
                f"--expert-tensor-parallel-size ({etp})")
        shared = moe.shared_expert_intermediate_size  # split over TP, as a dense MLP
        require(shared is None or shared % tp == 0,
                f"--moe-shared-expert-intermediate-size ({shared}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})")
        if not self.train.skip_train:  # (evaluating a converted top-1 Mixtral is fine)
            moe.check_router_gradient()
        moe.check_expert_parallel(ep)
        exe.check_layout(ep, etp, expert_biases=self.model.add_bias_linear)
        if self.moe_training.use_upcycling:
            require(moe.ffn_hidden_size == self.model.ffn_hidden_size,
                    f"--moe-use-upcycling copies the dense MLP into each expert: "
                    f"--moe-ffn-hidden-size ({moe.ffn_hidden_size}) must equal "
                    f"--ffn-hidden-size ({self.model.ffn_hidden_size})")
            require(tp == 1, "not supported yet: --moe-use-upcycling with "
                             "--tensor-model-parallel-size > 1")

    def _validate_recompute(self) -> None:
        """Recompute modules must name something this model has (Megatron would silently
        recompute nothing); moe_act needs the grouped experts, as Megatron."""
        r, m = self.recompute, self.model
        selected = r.selected
        moe_layers = [m.is_moe_layer(i) for i in range(m.num_layers)]
        for name, present, what in (
                ("moe", any(moe_layers), "MoE layers (--num-experts)"),
                ("moe_act", any(moe_layers), "MoE layers (--num-experts)"),
                ("shared_experts", m.moe is not None
                 and m.moe.shared_expert_intermediate_size is not None,
                 "shared experts (--moe-shared-expert-intermediate-size)"),
                ("mlp", not all(moe_layers), "dense MLP layers"),
                ("mla_up_proj", m.multi_latent_attention,
                 "multi-latent attention (--multi-latent-attention)")):
            require(name not in selected or present,
                    f"--recompute-modules {name} needs {what}; this model has none")
        require("moe_act" not in selected or self.moe_execution.grouped_gemm,
                "--recompute-modules moe_act needs --moe-grouped-gemm (as in Megatron-LM)")
        require(r.num_layers is None or r.num_layers <= m.num_layers,
                f"--recompute-num-layers ({r.num_layers}) must be at most --num-layers "
                f"({m.num_layers})")

    def _validate_checkpoint(self) -> None:
        """The single-file format holds rank 0's tensors: only layouts where rank 0 has
        them all can save it."""
        c, p = self.checkpoint, self.parallel
        if c.ckpt_format != "torch" or c.save is None:
            return
        for name, size in (("--tensor-model-parallel-size", p.tensor_model_parallel_size),
                           ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
                           ("--expert-model-parallel-size", p.expert_model_parallel_size)):
            if size > 1:
                raise ConfigError(f"--ckpt-format torch (single file) cannot save with "
                                  f"{name} > 1: use --ckpt-format torch_dist")
        require(not (p.use_distributed_optimizer
                     and p.data_parallel_size * p.context_parallel_size > 1),
                "--ckpt-format torch (single file) cannot save with --use-distributed-"
                "optimizer and data-parallel size > 1: use --ckpt-format torch_dist")

    def _validate_fp8_param_gather(self) -> None:
        """--fp8-param-gather: the distributed optimizer holds the FP8 weights (Megatron's
        rule); the layouts and formats its FP8 buffers are not built for are named."""
        require(self.parallel.use_distributed_optimizer,
                "--fp8-param-gather only supported with distributed optimizer (Megatron-LM: "
                "add --use-distributed-optimizer)")
        require(self.model.transformer_impl == "local",
                "not supported yet: --fp8-param-gather with --transformer-impl "
                "transformer_engine")
        require(not (self.checkpoint.save and self.checkpoint.ckpt_format == "torch"),
                "not supported yet: --fp8-param-gather with --ckpt-format torch (use "
                "torch_dist)")

    def _validate_fp8(self) -> None:
        """FP8 combinations not built yet (config/fp8.py checks the FP8 flags themselves)."""
        require(not (self.fp8.recipe == "delayed" and self.checkpoint.save
                     and self.checkpoint.ckpt_format == "torch"),
                "not supported yet: --ckpt-format torch with --fp8-recipe delayed (its amax "
                "histories are saved in torch_dist checkpoints only)")
        require(not (self.model.moe is not None and self.moe_execution.adaptive_parallelism),
                "not supported yet: --fp8-format with --moe-adaptive-parallelism")
        if self.fp8.param_gather:
            self._validate_fp8_param_gather()
        if self.fp8.router_padding:
            moe = self.model.moe
            require(moe is not None, "--moe-router-padding-for-quantization needs an MoE "
                    "model (--num-experts)")
            require(moe.capacity_factor is None, "not supported yet: "
                    "--moe-router-padding-for-quantization with --moe-expert-capacity-factor")
            require(self.parallel.tensor_model_parallel_size == 1, "not supported yet: "
                    "--moe-router-padding-for-quantization with --tensor-model-parallel-size "
                    "> 1")
        # Megatron's TELMHeadColumnParallelLinear refuses skip_weight_param_allocation: the
        # MXFP8 head cannot use the word embedding's weight on the stage holding both
        require(not self.fp8.output_proj or self.model.untie_embeddings_and_output_weights
                or self.parallel.pipeline_model_parallel_size > 1,
                "--fp8-output-proj with tied embeddings on one pipeline stage: Megatron-LM's "
                "MXFP8 output layer cannot share the embedding's weight there (TE output "
                "projection does not support skip_weight_param_allocation); add "
                "--untie-embeddings-and-output-weights")
        if self.fp8.first_last_layers_bf16:  # Megatron's TransformerConfig bound
            per_stage = self.model.num_layers // self.parallel.pipeline_model_parallel_size
            for name in ("start", "end"):
                value = getattr(self.fp8, f"num_layers_at_{name}_in_bf16")
                require(value <= per_stage,
                        f"--num-layers-at-{name}-in-bf16 ({value}) must be between 0 and the "
                        f"number of layers per pipeline stage ({per_stage})")
