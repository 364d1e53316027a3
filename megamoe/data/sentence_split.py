"""tools/preprocess_data.py --split-sentences: Megatron-LM's nltk punkt split, same calls.

Megatron's Encoder.initializer loads `nltk.load("tokenizers/punkt/{lang}.pickle")`; since
nltk 3.9 that load reads no pickle: nltk.data.load hands any `tokenizers/punkt/*.pickle`
path to `switch_punkt(lang)`, which returns `PunktTokenizer(lang)` over the pickle-free
`punkt_tab` data files. megamoe calls `PunktTokenizer(lang)` itself (what that load
returns), so nltk's own data path (NLTK_DATA, ~/nltk_data, <prefix>/nltk_data, ...)
decides where the data comes from. (Megatron with NLTK_DATA set asks for
`file:$NLTK_DATA/tokenizers/punkt/{lang}.pickle` instead, a path nltk >= 3.9 does not
redirect: it must be a pickle, which nltk's restricted unpickler refuses, so that branch
of Megatron's script cannot run on nltk >= 3.9; docs/training-your-own-data.md.)

--keep-newlines is Megatron's CustomLanguageVars: a PunktSentenceTokenizer over the same
parameters whose period context takes `\\s*` instead of `\\s+`, so the newline after a
sentence stays with the next sentence. Text is split in pieces of 1,000,000 characters,
each tokenized on its own, as Megatron's Encoder.split does.

nltk is optional (megamoe's `data` extra): without it, or without the punkt_tab data for
--lang, `load_splitter` raises DataError with one line saying what is missing and how to
get it.
"""

from __future__ import annotations

import os

from megamoe.data.errors import DataError

MAX_CHARS = 1_000_000  # Megatron's Encoder.split: max_len

# Megatron's CustomLanguageVars._period_context_fmt, character for character (the
# verbose regex's whitespace and comments are part of the pattern string).
PERIOD_CONTEXT_KEEP_NEWLINES = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        \s*                       #  <-- THIS is what I changed
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            (?P<next_tok>\S+)     #  <-- Normally you would have \s+ here
        ))"""

INSTALL_NLTK = "pip install 'nltk>=3.9' (megamoe's [data] extra)"
GET_DATA = "python -m nltk.downloader punkt_tab"


def _nltk():
    try:
        import nltk
        from nltk.tokenize import punkt
    except ImportError:
        raise DataError(f"--split-sentences needs nltk, which is not installed: "
                        f"{INSTALL_NLTK}") from None
    if not hasattr(punkt, "PunktTokenizer"):
        raise DataError(f"--split-sentences needs nltk >= 3.9 (installed: {nltk.__version__}; "
                        f"older nltk loads punkt from a pickle): {INSTALL_NLTK}")
    return nltk, punkt


def load_splitter(lang: str, keep_newlines: bool):
    """The sentence splitter Megatron's worker builds for --lang / --keep-newlines."""
    nltk, punkt = _nltk()
    try:
        splitter = punkt.PunktTokenizer(lang)
    except LookupError:
        where = os.environ.get("NLTK_DATA") or ", ".join(nltk.data.path[:3]) + ", ..."
        raise DataError(f"nltk's punkt_tab data for --lang {lang} not found "
                        f"(tokenizers/punkt_tab/{lang}/ under {where}): get it with "
                        f"`{GET_DATA}` or set NLTK_DATA to a folder holding it") from None
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise DataError(f"nltk's punkt_tab data for --lang {lang} is unreadable: "
                        f"{' '.join(str(e).split())}") from None
    if not keep_newlines:
        return splitter

    class CustomLanguageVars(punkt.PunktLanguageVars):
        _period_context_fmt = PERIOD_CONTEXT_KEEP_NEWLINES

    return punkt.PunktSentenceTokenizer(train_text=splitter._params,
                                        lang_vars=CustomLanguageVars())


def split_text(splitter, text: str) -> list[str]:
    """`text`'s sentences, splitting each 1,000,000-character piece on its own."""
    return [s for i in range(0, len(text), MAX_CHARS)
            for s in splitter.tokenize(text[i:i + MAX_CHARS])]
