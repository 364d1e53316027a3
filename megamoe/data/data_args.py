"""Megatron's --data-args-path and --per-split-data-args-path: data blends read from files.

A blend of thousands of prefixes is too long for a command line, so Megatron reads it
from a file (megatron/training/utils.py, get_blend_and_blend_per_split):
- --data-args-path FILE: the file's whitespace-separated words are exactly what
  --data-path would take ("p1 p2" or "w1 p1 w2 p2"); it may not be combined with
  --data-path.
- --per-split-data-args-path FILE: a JSON object with the keys "train", "valid" and
  "test", each a string (split on whitespace), a list of words, or null (no such split);
  it stands for --train-data-path / --valid-data-path / --test-data-path.
As in Megatron, --data-path or --data-args-path wins over the per-split forms.
"""

from __future__ import annotations

import json
from typing import Optional

from megamoe.config import DataConfig
from megamoe.data.errors import DataError

SPLITS = ("train", "valid", "test")


def read_data_args(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            words = f.read().split()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read --data-args-path ({e})") from None
    if not words:
        raise DataError(f"{path}: --data-args-path file is empty")
    return words


def _split_words(path: str, split: str, value) -> Optional[list[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        value = value.split()
    if (not isinstance(value, list) or not value or any(
            isinstance(v, bool) or not isinstance(v, (str, int, float)) for v in value)):
        raise DataError(f"{path}: \"{split}\" must be a string or a list of weights and "
                        "prefixes (or null)")
    return [str(v) for v in value]


def read_per_split_data_args(path: str) -> tuple[Optional[list[str]], ...]:
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read --per-split-data-args-path ({e})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(spec, dict) or any(s not in spec for s in SPLITS):
        raise DataError(f"{path}: expected a JSON object with the keys "
                        "\"train\", \"valid\" and \"test\"")
    return tuple(_split_words(path, s, spec[s]) for s in SPLITS)


def resolve_data_paths(config: DataConfig) -> tuple[Optional[list[str]], tuple]:
    """(the --data-path words or None, the three per-split word lists or Nones)."""
    if config.data_path or config.data_args_path:
        words = config.data_path or read_data_args(config.data_args_path)
        return list(words), (None, None, None)
    if config.per_split_data_args_path:
        return None, read_per_split_data_args(config.per_split_data_args_path)
    return None, (config.train_data_path, config.valid_data_path, config.test_data_path)
