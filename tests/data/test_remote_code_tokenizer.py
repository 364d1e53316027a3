"""--trust-remote-code (data/remote_tokenizer.py): a HuggingFaceTokenizer directory whose
tokenizer_config.json `auto_map` names a class in the directory's own .py file is loaded
by transformers' AutoTokenizer (from the directory, no network) only with the flag;
without it the launch fails with one line naming the flag. The directory here is built by
the test: a character-level tokenizer in tokenization_tiny.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex

import pytest

from megamoe.cli.main import main
from megamoe.data import DataError, build_tokenizer
from megamoe.data.remote_tokenizer import remote_code_class
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

pytest.importorskip("transformers", reason="a code tokenizer is loaded by transformers")

CHARS = "abcdefghijklmnopqrstuvwxyz "
CODE = f'''
from transformers import PreTrainedTokenizer

CHARS = {CHARS!r}


class TinyCharTokenizer(PreTrainedTokenizer):
    model_input_names = ["input_ids"]

    def __init__(self, **kwargs):
        self._vocab = {{c: i for i, c in enumerate(CHARS)}}
        self._vocab["<eos>"] = len(self._vocab)
        self._inv = {{i: c for c, i in self._vocab.items()}}
        kwargs.setdefault("eos_token", "<eos>")
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self._vocab)

    def get_vocab(self):
        return dict(self._vocab)

    def _tokenize(self, text):
        return [c for c in text if c in self._vocab]

    def _convert_token_to_id(self, token):
        return self._vocab[token]

    def _convert_id_to_token(self, index):
        return self._inv[index]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def build_inputs_with_special_tokens(self, ids, ids2=None):
        return ids + [self._vocab["<eos>"]]

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''
AUTO_MAP = {"AutoTokenizer": ["tokenization_tiny.TinyCharTokenizer", None]}


@pytest.fixture
def code_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may come from the network
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenization_tiny.py").write_text(CODE)
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TinyCharTokenizer", "auto_map": AUTO_MAP, "eos_token": "<eos>"}))
    return str(d)


def test_code_tokenizer_runs_with_the_flag(code_tokenizer):
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=code_tokenizer,
                          trust_remote_code=True)
    eos = len(CHARS)
    assert (tok.vocab_size, tok.eod) == (len(CHARS) + 1, eos)
    # Megatron's wrapper: tokenizer(text).input_ids, the tokenizer's special tokens in.
    assert tok.tokenize("hi z") == [7, 8, 26, 25, eos]
    assert tok.detokenize(tok.tokenize("hi z")) == "hi z"
    assert pickle.loads(pickle.dumps(tok)).tokenize("ab") == [0, 1, eos]  # loader workers


def test_code_tokenizer_without_the_flag_is_one_line(code_tokenizer):
    with pytest.raises(DataError, match="pass --trust-remote-code to run it"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=code_tokenizer)


LAUNCH = f"{TINY_MOE} --train-iters 1 --dry-run".replace("--tokenizer-type NullTokenizer ", "")


def test_launch(code_tokenizer, capsys):
    """pretrain_gpt.py: with the flag the dry run sizes the model from the code
    tokenizer's vocabulary; without it: exit 1, one line naming the flag."""
    argv = shlex.split(f"{LAUNCH} --tokenizer-type HuggingFaceTokenizer "
                       f"--tokenizer-model {code_tokenizer}")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trust-remote-code" in err, err
    params = {}
    for name, extra in (("code", argv[len(shlex.split(LAUNCH)):] + ["--trust-remote-code"]),
                        ("28 ids", ["--tokenizer-type", "NullTokenizer", "--vocab-size", "28"]),
                        ("200 ids", ["--tokenizer-type", "NullTokenizer", "--vocab-size",
                                     "200"])):
        assert main(shlex.split(LAUNCH) + extra + ["--json"]) == 0
        out = capsys.readouterr().out.strip().splitlines()[-1]
        params[name] = json.loads(out)["parameters"]
    assert params["code"] == params["28 ids"] != params["200 ids"]


def test_flag_needs_the_huggingface_tokenizer(capsys):
    err = parse_error(capsys, f"{TINY_MOE} --train-iters 1 --trust-remote-code", 1)
    assert "--trust-remote-code needs --tokenizer-type HuggingFaceTokenizer" in err


@pytest.mark.parametrize("config, message", [
    ({"auto_map": ["x"]}, "auto_map must be an object, got list"),
    ({"auto_map": {"AutoTokenizer": 3}}, "auto_map.AutoTokenizer must name a class"),
    ({"auto_map": {"AutoTokenizer": [None, None]}}, "auto_map.AutoTokenizer must name a class"),
])
def test_untrusted_auto_map_is_checked(tmp_path, config, message):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=message):
        remote_code_class(str(tmp_path))


def test_code_and_a_tokenizer_json(code_tokenizer):
    """Code and a tokenizer.json: the flag runs the code (transformers' choice with
    trust_remote_code=True); without it the tokenizer.json is read and no code runs."""
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "hi": 1, "<eos>": 2}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(
        os.path.join(code_tokenizer, "tokenizer.json"))
    plain = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=code_tokenizer)
    assert (type(plain).__name__, plain.vocab_size, plain.eod) == ("HuggingFaceTokenizer", 3, 2)
    code = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=code_tokenizer,
                           trust_remote_code=True)
    assert (type(code).__name__, code.vocab_size) == ("RemoteCodeTokenizer", len(CHARS) + 1)
    assert remote_code_class(code_tokenizer) == "tokenization_tiny.TinyCharTokenizer"
