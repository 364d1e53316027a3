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
    "swiglu": "--swiglu", "quick_geglu": "--quick-geglu",
    "add_bias_linear": "--disable-bias-linear",
    "position_embedding_type": "--position-embedding-type",
}
_MOE_SHAPE_FIELDS = {"num_experts": "--num-experts", "ffn_hidden_size": "--moe-ffn-hidden-size"}


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def saved_padded_vocab_size(saved: dict) -> Optional[int]:
    """The embedding rows of a checkpoint's model config dict (any megamoe version); None
    where the fields that decide it are absent or not positive integers (untrusted)."""
    if "padded_vocab_size" in saved:
        v = saved["padded_vocab_size"]
        return v if _positive_int(v) else None
    if not _positive_int(saved.get("vocab_size")):
        return None
    for name in ("fixed_padded_vocab_size", "padded_vocab_size_from_checkpoint"):
        v = saved.get(name)  # --padded-vocab-size, or a kept size (a file's: checked)
        if _positive_int(v):
            return v
    tp = saved.get("vocab_padding_tp", 1)  # absent: written when padding ignored TP
    m = saved.get("make_vocab_size_divisible_by", 1)
    m = (m if _positive_int(m) else 1) * (tp if _positive_int(tp) else 1)
    return -(-saved["vocab_size"] // m) * m


_PLAIN = (int, float, str, bool, type(None))


def _plain(value: Any) -> bool:
    """A value a saved config may hold: a scalar, or a list/tuple of scalars (compared with
    `!=`, which a tensor or an odd object would turn into a traceback)."""
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def _check_types(file: str, saved: Any) -> None:
    """The saved config (an untrusted field) is a dict of plain values, its `moe` a dict."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{file}: field model_config must be a dict "
                              f"(found {type(saved).__name__})")
    moe = saved.get("moe")
    for where, table, names in (("model_config", saved, list(_SHAPE_FIELDS) + [
            "vocab_size", "make_vocab_size_divisible_by", "vocab_padding_tp",
            "moe_layer_pattern"]), ("model_config.moe", moe or {}, list(_MOE_SHAPE_FIELDS))):
        if not isinstance(table, dict):
            raise CheckpointError(f"{file}: field {where} must be a dict "
                                  f"(found {type(table).__name__})")
        for name in names:
            if name in table and not _plain(table[name]):
                raise CheckpointError(f"{file}: field {where}.{name} has the wrong type "
                                      f"({type(table[name]).__name__})")


def check_model_config(file: str, saved: Optional[dict], config: Any) -> None:
    """Name the first flag whose value differs from the checkpoint's (shape-relevant only)."""
    if saved is None or config is None or not hasattr(config, "num_layers"):
        return
    _check_types(file, saved)
    if not saved:
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
