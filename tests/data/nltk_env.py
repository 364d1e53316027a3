"""nltk for the --split-sentences tests, and punkt_tab data trained here.

nltk is an optional dependency (megamoe's `data` extra), not in the test venv: the tests
use nltk 3.10.4 from a `pip install --no-deps --target` folder cached under
~/.cache/megamoe/nltk-site (pure Python; its import needs only regex and tqdm, which
both megamoe's venv and the megatron-core peer venv have), put on PYTHONPATH of the
subprocesses and on sys.path of the test process.

nltk's punkt_tab data comes only from nltk.download (a network fetch from nltk's data
index, not a package registry), so the tests make their own: nltk's PunktTrainer over
the bundled Shakespeare, saved by nltk's own save_punkt_params as
`tokenizers/punkt_tab/english/{collocations.tab, sent_starters.txt, abbrev_types.txt,
ortho_context.tab}`, the layout `PunktTokenizer("english")` loads.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import sys

from tests.cached_venv import cached_path

NLTK = "nltk==3.10.4"
KEY = "nltk3.10.4-py3"
ROOT_CACHE = os.path.join(os.path.expanduser(os.environ.get("MEGAMOE_CACHE",
                                                            "~/.cache/megamoe")), "nltk-site")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAKESPEARE = os.path.join(ROOT, "data", "shakespeare", "shakespeare.jsonl.xz")


class NltkUnavailable(RuntimeError):
    """nltk cannot be installed into the cache here; the message says why."""


def _build(final: str) -> None:
    tmp = f"{final}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--target", tmp, NLTK], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise NltkUnavailable(f"pip install {NLTK} failed: {tail[:200]}")
    os.replace(tmp, final)


def nltk_site() -> str:
    """The folder holding nltk 3.10.4 (for PYTHONPATH), installing it once."""
    init = cached_path(ROOT_CACHE, KEY, _build, NltkUnavailable,
                       os.path.join("nltk", "__init__.py"))
    return os.path.dirname(os.path.dirname(init))


def shakespeare_text() -> list[str]:
    with lzma.open(SHAKESPEARE, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def train_punkt_tab(nltk_data: str, text: str, lang: str = "english") -> str:
    """nltk_data/tokenizers/punkt_tab/<lang>/ trained on `text` by nltk's PunktTrainer and
    written by nltk's save_punkt_params (nltk must be importable)."""
    import nltk
    from nltk.tokenize.punkt import PunktTrainer, save_punkt_params

    trainer = PunktTrainer()
    trainer.INCLUDE_ALL_COLLOCS = True  # more collocations: more of punkt's rules in play
    trainer.train(text, finalize=True)
    lang_dir = os.path.join(nltk_data, "tokenizers", "punkt_tab", lang)
    os.makedirs(lang_dir, mode=0o700)
    nltk.data.path.insert(0, nltk_data)  # nltk writes only inside a data root on its path
    try:
        return save_punkt_params(trainer.get_params(), dir=lang_dir)
    finally:
        nltk.data.path.remove(nltk_data)
