"""The one exception type for user-caused data problems."""

from __future__ import annotations


class DataError(Exception):
    """Bad, missing or corrupt data or tokenizer file.

    The message is a single line naming the file and what is wrong: pretrain_gpt.py and the
    tools print it as-is and exit 1, so it must make sense without a traceback.
    """
