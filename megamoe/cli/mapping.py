"""Validated Megatron-style namespace -> the small per-feature config dataclasses.

Kept apart from `argument_rules` (which only derives defaults and checks rules) so each
layer receives its own dataclass, never the whole argument namespace.
"""

from __future__ import annotations

import argparse

from megamoe.config import (
    DataConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)


def args_to_configs(args: argparse.Namespace, vocab_size: int) -> RunConfig:
    """Validated namespace (+ the tokenizer's vocabulary size) -> per-feature configs."""
    moe = None
    if args.num_experts is not None:
        moe = MoEConfig(
            num_experts=args.num_experts,
            topk=args.moe_router_topk,
            ffn_hidden_size=args.moe_ffn_hidden_size,
            score_function=args.moe_router_score_function,
            pre_softmax=args.moe_router_pre_softmax,
            topk_scaling_factor=args.moe_router_topk_scaling_factor,
            num_groups=args.moe_router_num_groups,
            group_topk=args.moe_router_group_topk,
            router_dtype=args.moe_router_dtype,
            input_jitter_eps=args.moe_input_jitter_eps,
            enable_expert_bias=args.moe_router_enable_expert_bias,
            bias_update_rate=args.moe_router_bias_update_rate,
            load_balancing_types=list(args.moe_router_load_balancing_type),
            aux_loss_coeffs=list(args.moe_aux_loss_coeff),
            z_loss_coeff=args.moe_z_loss_coeff,
            capacity_factor=args.moe_expert_capacity_factor,
            pad_to_capacity=args.moe_pad_expert_input_to_capacity,
            token_drop_policy=args.moe_token_drop_policy,
            grouped_gemm=args.moe_grouped_gemm,
            token_dispatcher_type=args.moe_token_dispatcher_type,
            a2a_overlap_degree=args.moe_a2a_overlap_degree,
            adaptive_parallelism=args.moe_adaptive_parallelism,
            shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            shared_expert_gate=args.moe_shared_expert_gate,
            per_layer_logging=args.moe_per_layer_logging,
            use_upcycling=args.moe_use_upcycling,
        )
    pos_type = args.position_embedding_type
    if pos_type == "learned_absolute" and not args.add_position_embedding:
        pos_type = "none"
    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        position_embedding_type=pos_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        swiglu=args.swiglu,
        add_bias_linear=args.add_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        moe=moe,
        moe_layer_pattern=getattr(args, "moe_layer_pattern", None) if moe else None,
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        use_distributed_optimizer=args.use_distributed_optimizer,
        world_size=args.world_size,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
    )
    data = DataConfig(
        data_path=args.data_path, train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path, test_data_path=args.test_data_path,
        split=args.split, mock_data=args.mock_data, data_cache_path=args.data_cache_path,
        tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
        seq_length=args.seq_length, num_workers=args.num_workers, seed=args.seed,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
    )
    optim = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr if args.lr is not None else 0.0,
        min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        lr_warmup_iters=args.lr_warmup_iters, lr_warmup_fraction=args.lr_warmup_fraction,
        lr_warmup_init=args.lr_warmup_init, lr_decay_iters=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, lr_wsd_decay_iters=args.lr_wsd_decay_iters,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
    train = TrainConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters or 0, seed=args.seed, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, skip_train=args.skip_train,
        exit_interval=args.exit_interval, exit_duration_in_mins=args.exit_duration_in_mins,
        save=args.save, load=args.load, save_interval=args.save_interval,
        no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
        no_save_optim=args.no_save_optim, no_save_rng=args.no_save_rng,
        finetune=args.finetune, async_save=args.async_save,
        ckpt_keep_last=args.ckpt_keep_last, ckpt_format=args.ckpt_format,
        log_interval=args.log_interval,
        tensorboard_dir=args.tensorboard_dir,
        tensorboard_log_interval=args.tensorboard_log_interval,
        wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
        wandb_save_dir=args.wandb_save_dir, log_throughput=args.log_throughput,
        peak_tflops=args.peak_tflops,
        timing_log_level=args.timing_log_level,
    )
    return RunConfig(model=model, parallel=parallel, data=data, optim=optim, train=train)
