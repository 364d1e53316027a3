"""--use-checkpoint-args: the model's shape from the --load checkpoint's saved arguments,
with Megatron-LM's semantics (megatron/training/checkpointing.py load_args_from_checkpoint):
the sizes it sets without `force` (layers, hidden, FFN, sequence, heads, kv channels,
positions, the padded vocabulary) fill only what the command line left unset; the rest
(attention grouping, positions, biases, activation, norms, tying, and the MoE/MLA/MTP
shape) are taken from the checkpoint over the command line. Read before the rules run, so
the checked arguments are the ones the run will use. A checkpoint from Megatron-LM itself
is converted first (tools/checkpoint/convert.py megatron-to-megamoe), which writes these
same names.
"""

from __future__ import annotations

import argparse
import os

from megamoe.training.checkpoint.dist import read_common
from megamoe.training.checkpoint.publish import checkpoint_file, is_dist_checkpoint
from megamoe.training.checkpoint.safe_load import CheckpointError, load_torch_file

# Set only where the command line left them None (Megatron: _set_arg without force).
FILL = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
        "kv_channels", "max_position_embeddings", "padded_vocab_size")
# Taken from the checkpoint over the command line (Megatron: force=True).
FORCE = ("num_query_groups", "group_query_attention", "position_embedding_type",
         "rotary_percent", "rotary_base", "add_bias_linear", "add_qkv_bias", "swiglu",
         "untie_embeddings_and_output_weights", "normalization", "norm_epsilon",
         "qk_layernorm", "make_vocab_size_divisible_by", "num_experts", "moe_router_topk",
         "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
         "moe_shared_expert_gate", "moe_router_score_function",
         "moe_router_enable_expert_bias", "moe_router_pre_softmax",
         "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
         "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
         "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers")


def saved_args(load: str) -> dict:
    """The arguments saved with the checkpoint --load resumes from (either format)."""
    found = checkpoint_file(load) if os.path.exists(load) else None
    if found is None:
        raise CheckpointError(f"--use-checkpoint-args: no checkpoint in --load {load}")
    state = read_common(found) if is_dist_checkpoint(found) else load_torch_file(found)
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, dict):
        raise CheckpointError(f"{found}: holds no saved arguments for --use-checkpoint-args")
    return args


def apply_checkpoint_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Overwrite `args` from the --load checkpoint as Megatron-LM does; only dests the
    parser knows are set, each with a value of the type the parser would give it."""
    if args.load is None:
        parser.error("--use-checkpoint-args needs --load")
    saved = saved_args(args.load)
    known = {a.dest: a for a in parser._actions}
    for name in FILL + FORCE:
        if name not in saved or name not in known:
            continue
        if name in FILL and getattr(args, name) is not None:
            continue
        value, action = saved[name], known[name]
        if value is not None and action.type is not None and not isinstance(value, bool):
            try:
                value = action.type(str(value))
            except (TypeError, ValueError):
                raise CheckpointError(f"--load {args.load}: saved {name} = {value!r} is "
                                      "not a valid value") from None
        setattr(args, name, value)
