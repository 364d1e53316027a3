"""Does a checkpoint fit the model it is loaded into? The first shape-relevant setting
that differs is named with the flag that sets it."""

from __future__ import annotations

from typing import Any, Optional

from megamoe.training.checkpoint.safe_load import CheckpointError

# ModelConfig fields that decide parameter shapes, with the flag that sets each.
_SHAPE_FIELDS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels",
    "padded_vocab_size": "the tokenizer's vocabulary / --make-vocab-size-divisible-by / "
                         "--padded-vocab-size",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "swiglu": "--swiglu", "add_bias_linear": "--disable-bias-linear",
    "position_embedding_type": "--position-embedding-type",
}
_MOE_SHAPE_FIELDS = {"num_experts": "--num-experts", "ffn_hidden_size": "--moe-ffn-hidden-size"}


def saved_padded_vocab_size(saved: dict) -> Optional[int]:
    """The embedding rows of a checkpoint's model config dict (any megamoe version)."""
    if "padded_vocab_size" in saved:
        return int(saved["padded_vocab_size"])
    if not isinstance(saved.get("vocab_size"), int):
        return None
    for name in ("fixed_padded_vocab_size", "padded_vocab_size_from_checkpoint"):
        v = saved.get(name)  # --padded-vocab-size, or a kept size (a file's: checked)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    tp = saved.get("vocab_padding_tp", 1)  # absent: written when padding ignored TP
    m = saved.get("make_vocab_size_divisible_by", 1) * (tp if isinstance(tp, int) else 1)
    return -(-saved["vocab_size"] // m) * m


def check_model_config(file: str, saved: Optional[dict], config: Any) -> None:
    """Name the first flag whose value differs from the checkpoint's (shape-relevant only)."""
    if not saved or config is None or not hasattr(config, "num_layers"):
        return
    mine = dict(vars(config), padded_vocab_size=config.padded_vocab_size)
    if "padded_vocab_size" not in saved and "vocab_size" in saved:
        saved = dict(saved, padded_vocab_size=saved_padded_vocab_size(saved))
    all_moe = bool(config.moe) and all(config.moe_layer_pattern or [])
    for name, flag in _SHAPE_FIELDS.items():
        if name == "ffn_hidden_size" and all_moe:
            continue  # no dense MLP to size
        if name in saved and saved[name] != mine.get(name):
            raise CheckpointError(f"{file}: checkpoint has {name}={saved[name]} but this run "
                                  f"has {mine.get(name)} ({flag})")
    saved_moe, my_moe = saved.get("moe") or {}, vars(config.moe) if config.moe else {}
    for name, flag in _MOE_SHAPE_FIELDS.items():
        a, b = saved_moe.get(name), my_moe.get(name)
        if a != b:
            raise CheckpointError(f"{file}: checkpoint has {name}={a} but this run has {b} "
                                  f"({flag})")
    if saved.get("moe_layer_pattern") != mine.get("moe_layer_pattern"):
        raise CheckpointError(f"{file}: checkpoint's MoE layers {saved.get('moe_layer_pattern')}"
                              f" differ from this run's (--moe-layer-freq)")
