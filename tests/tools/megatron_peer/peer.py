"""The megatron-core side of the Megatron-LM checkpoint tests. Runs in the peer venv
(mcore_venv.py), never imports megamoe.

    python peer.py save --variant mixtral --out SAVE_DIR --iteration 7
        builds a tiny megatron-core GPTModel (seeded, random norms and biases), saves it
        with dist_checkpointing.save in Megatron-LM's layout (tracker file, iter_0000007/,
        common state as Megatron-LM's training loop writes it), and writes the logits of
        TOKENS to SAVE_DIR/reference_logits.pt (and, with MTP, each depth's logits of
        TOKENS with LABELS in training mode to SAVE_DIR/reference_mtp_logits.pt)
    python peer.py load --variant mixtral --ckpt SAVE_DIR --out OUT.pt
        builds the same model, loads SAVE_DIR with dist_checkpointing.load (what
        Megatron-LM's --load does) and writes the logits of TOKENS; also the loaded
        common state's fields to OUT.pt.json

On CPU with gloo, following REFERENCE.md's recipe: cuda.current_device patched to the
CPU, the inference RNG tracker, an explicit causal mask, use_cpu_initialization.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

torch.cuda.current_device = lambda: torch.device("cpu")
torch.cuda.synchronize = lambda *a, **k: None

VOCAB = 128
SEQ = 16
TOKENS = [[(7 * i + 3 * b + 1) % 100 for i in range(SEQ)] for b in range(2)]
LABELS = [[(7 * i + 3 * b + 8) % 100 for i in range(SEQ)] for b in range(2)]  # next tokens

# DeepSeek-V3-style MLA (MLATransformerConfig fields): query and kv latents with their
# norms, YaRN with a softmax-scale mscale, head dims all different so a swapped split fails.
MLA = {"multi_latent_attention": True, "num_query_groups": None, "q_lora_rank": 24,
       "kv_lora_rank": 20, "qk_head_dim": 12, "qk_pos_emb_head_dim": 8, "v_head_dim": 10,
       "qk_layernorm": True, "rope_type": "yarn", "rotary_scaling_factor": 4.0,
       "mscale": 1.0, "mscale_all_dim": 1.0}

# variant -> TransformerConfig fields beyond the common Mixtral-like ones, and GPTModel's
# share_embeddings_and_output_weights
VARIANTS = {
    "mixtral": ({}, False),
    "shared_dense": ({"num_layers": 3, "moe_layer_freq": [0, 1, 1],
                      "moe_shared_expert_intermediate_size": 48,
                      "moe_shared_expert_gate": True,
                      "moe_router_score_function": "sigmoid",
                      "moe_router_enable_expert_bias": True}, False),
    "qk_norm": ({"qk_layernorm": True}, True),
    "mixtral4": ({"num_layers": 4}, False),  # enough layers for PP2 x 2 virtual stages
    # MLA + MTP (DeepSeek-V3's shape: a dense first layer, shared experts, sigmoid router
    # with expert bias, two MTP depths of the last layer's kind)
    "mla_mtp": ({**MLA, "num_layers": 2, "moe_layer_freq": [0, 1],
                 "moe_shared_expert_intermediate_size": 48,
                 "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                 "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3}, False),
    # a dense first layer and qk-layernorm (the TE stand-in's whole-TE-spec cases)
    "dense_qk": ({"num_layers": 2, "moe_layer_freq": [0, 1], "qk_layernorm": True}, False),
    # plain RoPE on the position part, no query latent, no latent norms, tied embeddings
    "mla_rope": ({**MLA, "q_lora_rank": None, "qk_layernorm": False, "rope_type": "rope",
                  "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}, True),
    # Megatron-LM's other activations (argument_utils.py: --squared-relu, --quick-geglu)
    # and --rotary-interleaved; activation_func named here, resolved in transformer_config
    "squared_relu": ({"activation_func": "squared_relu", "gated_linear_unit": False,
                      "num_layers": 2, "moe_layer_freq": [0, 1]}, False),
    "quick_geglu_interleaved": ({"activation_func": "quick_gelu", "rotary_interleaved": True,
                                 "num_layers": 2, "moe_layer_freq": [0, 1]}, False),
}
# the flags megamoe reads for each activation (megatron_args: the saved args' names)
ACTIVATION_ARGS = {"squared_relu": {"swiglu": False, "squared_relu": True},
                   "quick_gelu": {"swiglu": False, "quick_geglu": True}}


class MLACoreAttention(torch.nn.Module):
    """Core attention for megatron-core's MLASelfAttention on CPU. megatron-core's local
    DotProductAttention takes no k_channels / v_channels (MLA's q/k and v head dims
    differ; its MLA runs on TE's DotProductAttention, which needs a GPU), so the peer
    supplies this one: softmax(q k^T * softmax_scale + mask) v, with the softmax_scale
    MLASelfAttention computes (its YaRN mscale). Everything else is megatron-core's."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None, **_):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                packed_seq_params=None, **_):
        s, b, n, _ = query.shape  # [s, b, n, d]
        scores = torch.einsum("sbnd,tbnd->bnst", query, key) * self.softmax_scale
        scores = scores.masked_fill(attention_mask, float("-inf"))
        out = torch.einsum("bnst,tbnv->sbnv", scores.softmax(-1), value)
        return out.reshape(s, b, -1)


def init_process_group() -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)


def transformer_config(variant: str, **layout):
    """The variant's TransformerConfig; `layout`: parallel sizes (tensor_model_parallel_size,
    ...) for the sharded runs of peer_legacy.py."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    fields = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                  num_query_groups=2, kv_channels=16, num_moe_experts=4, moe_router_topk=2,
                  moe_ffn_hidden_size=80, normalization="RMSNorm", layernorm_epsilon=1e-5,
                  gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  use_cpu_initialization=True, params_dtype=torch.float32,
                  moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                  moe_router_load_balancing_type="none", bias_dropout_fusion=False,
                  apply_rope_fusion=False, persist_layer_norm=False,
                  gradient_accumulation_fusion=False, init_method_std=0.05)
    fields.update(VARIANTS[variant][0])
    fields.update(layout)
    if isinstance(fields["activation_func"], str):
        from megatron.core import activations

        fields["activation_func"] = getattr(activations, fields["activation_func"])
    cls = MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig
    return cls(**fields)


def _assert_te_stand_in() -> None:
    """megatron-core's TE extension imported with HAVE_TE from the peer's stand-in (never
    a real Transformer Engine, never none)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    assert HAVE_TE, "the TE spec needs the TE stand-in on PYTHONPATH (run_peer(te_stand_in=True))"
    import transformer_engine

    assert transformer_engine.__file__.startswith(os.path.dirname(os.path.abspath(__file__))), (
        f"{transformer_engine.__file__} is not the peer's TE stand-in")


def build_model(variant: str, vocab: int = VOCAB, layout: dict | None = None,
                stage: dict | None = None, te_spec: bool = False):
    """The variant's model; `layout` and `stage` (vp_stage, pp_rank, pre_process,
    post_process) build one pipeline chunk of a sharded run (peer_legacy.py). te_spec:
    megatron-core's own Transformer Engine spec (`--transformer-impl transformer_engine`,
    Megatron-LM's default: fused input / pre-MLP norms in linear_qkv / linear_fc1, TENorm
    elsewhere, TEDotProductAttention; TEGroupedMLP with moe_grouped_gemm) built on the TE
    stand-in (te_peer_stand_in/: TE's registration order, plain torch math)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    config = transformer_config(variant, **(layout or {}))
    stage = stage or {}
    if te_spec:
        _assert_te_stand_in()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te_spec,
                                      normalization="RMSNorm", vp_stage=stage.get("vp_stage"),
                                      pp_rank=stage.get("pp_rank"))
    assert te_spec or not config.moe_grouped_gemm, (
        "moe_grouped_gemm: megatron-core's LocalSpecProvider builds SequentialMLP; "
        "TEGroupedMLP comes with the TE spec (te_spec=True)")
    if config.multi_latent_attention:
        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
    mtp = (get_gpt_mtp_block_spec(config, spec, use_transformer_engine=te_spec)
           if config.mtp_num_layers else None)
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=vocab, mtp_block_spec=mtp,
                     max_sequence_length=SEQ, position_embedding_type="rope",
                     rotary_base=10000, share_embeddings_and_output_weights=VARIANTS[variant][1],
                     pre_process=stage.get("pre_process", True),
                     post_process=stage.get("post_process", True),
                     vp_stage=stage.get("vp_stage"))
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():  # norms (all ones at init) and expert biases made distinct
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if ("layernorm" in name or "layer_norm_weight" in name
                    or name.endswith("norm.weight") or "expert_bias" in name):
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=gen)
                        if "expert_bias" not in name else 0.1 * torch.randn(t.shape,
                                                                           generator=gen))
    return model.eval()


def logits(model) -> torch.Tensor:
    tokens = torch.tensor(TOKENS)
    pos = torch.arange(SEQ)[None].expand_as(tokens)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return model(tokens, pos, mask).float()


def mtp_logits(model) -> torch.Tensor:
    """[D, S, B, V]: each MTP depth's logits of TOKENS with LABELS, as process_mtp_loss
    hands them to compute_language_model_loss (training mode: MTP runs only there)."""
    seen = []
    loss_fn = model.compute_language_model_loss

    def record(labels, logits):
        seen.append(logits.detach().float().clone())
        return loss_fn(labels, logits)
    model.compute_language_model_loss = record
    tokens = torch.tensor(TOKENS)
    pos = torch.arange(SEQ)[None].expand_as(tokens)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    model.train()
    with torch.no_grad():
        model(tokens, pos, mask, labels=torch.tensor(LABELS))
    model.eval()
    model.compute_language_model_loss = loss_fn
    depths = model.config.mtp_num_layers
    assert len(seen) == depths + 1, len(seen)  # the depths, then the main head
    return torch.stack(seen[:depths])


def megatron_args(variant: str, iteration: int):
    """The fields of Megatron-LM's args Namespace (megatron/training/arguments.py names)
    that a GPT MoE run of this variant holds; the rest of a real Namespace is run
    bookkeeping."""
    fields, tied = VARIANTS[variant]
    c = transformer_config(variant)
    gbs = 8
    mla = {k: getattr(c, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                      "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                                      "rotary_scaling_factor", "mscale", "mscale_all_dim")
           } if c.multi_latent_attention else {}
    act = ACTIVATION_ARGS.get(fields.get("activation_func"), {})
    return argparse.Namespace(**mla, **act,
        num_layers=c.num_layers, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
        group_query_attention=not c.multi_latent_attention, num_query_groups=2,
        kv_channels=16, seq_length=SEQ,
        max_position_embeddings=SEQ, vocab_size=100, padded_vocab_size=VOCAB,
        make_vocab_size_divisible_by=128, normalization="RMSNorm", norm_epsilon=1e-5,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
        **({} if act else {"swiglu": True}), add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not tied, qk_layernorm=c.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05,
        apply_layernorm_1p=False, multi_latent_attention=c.multi_latent_attention,
        mtp_num_layers=c.mtp_num_layers, mtp_loss_scaling_factor=c.mtp_loss_scaling_factor,
        rotary_interleaved=c.rotary_interleaved, apply_rope_fusion=False,
        mla_down_proj_fusion=False,
        num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=80,
        moe_layer_freq=fields.get("moe_layer_freq", 1),
        moe_shared_expert_intermediate_size=fields.get("moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=fields.get("moe_shared_expert_gate", False),
        moe_router_score_function=c.moe_router_score_function,
        moe_router_enable_expert_bias=c.moe_router_enable_expert_bias,
        moe_router_pre_softmax=False, moe_router_topk_scaling_factor=None,
        moe_router_num_groups=None, moe_router_group_topk=None,
        moe_router_load_balancing_type=["none"], moe_aux_loss_coeff=[0.0],
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        transformer_impl="local", tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        params_dtype=torch.float32, fp16=False, bf16=False,
        micro_batch_size=2, global_batch_size=gbs, train_iters=20, lr=3e-4, min_lr=3e-5,
        lr_decay_style="cosine", lr_warmup_iters=2, lr_decay_iters=None, weight_decay=0.1,
        seed=1234, iteration=iteration, consumed_train_samples=iteration * gbs,
        consumed_valid_samples=0, ckpt_format="torch_dist", tokenizer_type="NullTokenizer",
    )


def scheduler_state(args) -> dict:
    """Megatron's OptimizerParamScheduler.state_dict() after `iteration` steps of
    global-batch-size samples (its steps count samples)."""
    gbs = args.global_batch_size
    return {"max_lr": args.lr, "lr_warmup_steps": args.lr_warmup_iters * gbs,
            "num_steps": args.consumed_train_samples, "lr_decay_style": args.lr_decay_style,
            "lr_decay_steps": args.train_iters * gbs, "min_lr": args.min_lr,
            "start_wd": args.weight_decay, "end_wd": args.weight_decay,
            "wd_incr_style": "constant", "wd_incr_steps": args.train_iters * gbs}


def save(variant: str, out: str, iteration: int) -> None:
    from megatron.core import dist_checkpointing

    model = build_model(variant)
    args = megatron_args(variant, iteration)
    # megatron/training/checkpointing.py generate_state_dict, with --no-save-optim and
    # --no-save-rng (the optimizer's and the RNG's sharded objects are not imported)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model.sharded_state_dict(), "opt_param_scheduler": scheduler_state(args),
             "num_floating_point_operations_so_far": 1.5e12}
    it_dir = os.path.join(out, f"iter_{iteration:07d}")
    os.makedirs(it_dir, exist_ok=True)
    dist_checkpointing.save(state, it_dir)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    torch.save(logits(model), os.path.join(out, "reference_logits.pt"))
    if model.config.mtp_num_layers:
        torch.save(mtp_logits(model), os.path.join(out, "reference_mtp_logits.pt"))


def load(variant: str, ckpt: str, out: str) -> None:
    from megatron.core import dist_checkpointing

    model = build_model(variant)
    with torch.no_grad():  # nothing of the fresh model may survive the load
        for t in model.state_dict().values():
            if isinstance(t, torch.Tensor) and torch.is_floating_point(t):
                t.fill_(float("nan"))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read().strip())
    it_dir = os.path.join(ckpt, f"iter_{iteration:07d}")
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, it_dir)
    model.load_state_dict(loaded["model"], strict=False)
    torch.save(logits(model), out)
    if model.config.mtp_num_layers:
        torch.save(mtp_logits(model), out + ".mtp")
    common = dist_checkpointing.load_common_state_dict(it_dir)
    info = {"iteration": common["iteration"], "checkpoint_version": common["checkpoint_version"],
            "args": {k: v for k, v in vars(common["args"]).items()
                     if isinstance(v, (int, float, str, bool, list, type(None)))},
            "opt_param_scheduler": common["opt_param_scheduler"],
            "keys": sorted(common)}
    with open(out + ".json", "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--variant", choices=sorted(VARIANTS), default="mixtral")
    p.add_argument("--out")
    p.add_argument("--ckpt")
    p.add_argument("--iteration", type=int, default=7)
    a = p.parse_args()
    torch.manual_seed(0)
    init_process_group()
    if a.mode == "save":
        save(a.variant, a.out, a.iteration)
    else:
        load(a.variant, a.ckpt, a.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
