"""--trust-remote-code: a Hugging Face tokenizer that is the model's own Python code.

Some tokenizers (Kimi-K2's and Moonlight's tiktoken tokenizers) ship no tokenizer.json:
their tokenizer_config.json names a class in a .py file of the same directory through
`auto_map` ({"AutoTokenizer": ["tokenization_x.XTokenizer", null]}). Megatron-LM loads every
HuggingFaceTokenizer with transformers' AutoTokenizer.from_pretrained(path,
trust_remote_code=args.trust_remote_code); megamoe reads a tokenizer.json directly with
`tokenizers` (data/tokenizers.py) and goes through transformers only for such a directory:

  * an AutoTokenizer `auto_map` and --trust-remote-code: AutoTokenizer.from_pretrained(
    path, trust_remote_code=True, local_files_only=True) runs the directory's code (never
    the network), as transformers does for Megatron with the flag, tokenizer.json or not;
  * an `auto_map` without the flag: its tokenizer.json is read if it has one (no code
    runs), else one line naming the flag;
  * no `auto_map`: the tokenizer.json, with or without the flag (nothing to trust).

As Megatron's wrapper: vocab_size = len(tokenizer) (special tokens included), eod = its
eos token id, tokenize = tokenizer(text).input_ids (its special tokens included).
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from megamoe.data.errors import DataError


def remote_code_class(directory: str) -> Optional[str]:
    """The `auto_map` AutoTokenizer class named by `directory`'s tokenizer_config.json
    (e.g. "tokenization_kimi.TikTokenTokenizer"), None if it names none. The file is
    untrusted: every field read is checked."""
    cfg = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(cfg):
        return None
    try:
        with open(cfg, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{cfg}: unreadable tokenizer config ({_one_line(e)})") from None
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if auto_map is None:
        return None
    if not isinstance(auto_map, dict):
        raise DataError(f"{cfg}: auto_map must be an object, got {type(auto_map).__name__}")
    entry = auto_map.get("AutoTokenizer")
    if entry is None:
        return None
    names = entry if isinstance(entry, list) else [entry]
    if not names or not all(n is None or isinstance(n, str) for n in names) \
            or not any(names):
        raise DataError(f"{cfg}: auto_map.AutoTokenizer must name a class (a string or a "
                        f"list of strings and nulls), got {entry!r}")
    return next(n for n in names if n)


class RemoteCodeTokenizer:
    """A tokenizer directory whose own code transformers runs (--trust-remote-code)."""

    def __init__(self, directory: str, class_name: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(f"{directory}: its tokenizer is Python code ({class_name}), "
                            "which needs the transformers package") from None
        self.path, self.class_name = directory, class_name
        try:
            self._tok = AutoTokenizer.from_pretrained(directory, trust_remote_code=True,
                                                      local_files_only=True)
        except Exception as e:  # the directory's own code may raise anything
            raise DataError(f"{directory}: its tokenizer code ({class_name}) failed to load "
                            f"({type(e).__name__}: {_one_line(e)})") from None
        self.vocab_size = int(len(self._tok))
        eod = self._tok.eos_token_id
        if not isinstance(eod, int) or not 0 <= eod < self.vocab_size:
            raise DataError(f"{directory}: the tokenizer ({class_name}) has no end-of-text "
                            f"token id in [0, {self.vocab_size}) (eos_token_id={eod!r})")
        self.eod = eod

    def tokenize(self, text: str) -> list[int]:
        return [int(i) for i in self._tok(text)["input_ids"]]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __getstate__(self) -> dict:  # the directory's classes need not pickle; reload
        return {"path": self.path, "class_name": self.class_name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["class_name"])


def load_remote_code_tokenizer(directory: str, trust_remote_code: bool
                               ) -> Optional[RemoteCodeTokenizer]:
    """`directory`'s code tokenizer when it names one and the flag trusts it; None when
    its tokenizer.json is to be read. Code and no tokenizer.json without
    --trust-remote-code: one line naming the flag."""
    class_name = remote_code_class(directory)
    if class_name is None:
        return None
    if trust_remote_code:
        return RemoteCodeTokenizer(directory, class_name)
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return None
    raise DataError(f"{directory}: the tokenizer is the directory's own Python code "
                    f"({class_name}, auto_map in tokenizer_config.json); pass "
                    "--trust-remote-code to run it")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
