"""tools/prepare_data_cache.py builds a run's indices ahead of it; the run then only
loads them (no index is built twice)."""

from __future__ import annotations

import os
import shlex

from megamoe.config import DataConfig
from megamoe.data import build_gpt_datasets, build_tokenizer
from tests.data.test_blended_dataset import _corpus
from tests.test_arguments import BASE
from tools.prepare_data_cache import main

EOD = 5000


def test_prepare_then_run_builds_nothing(tmp_path, capsys):
    a = _corpus(tmp_path / "a", 1000, 40, EOD)
    b = _corpus(tmp_path / "b", 3000, 40, EOD)
    cache = tmp_path / "cache"
    flags = BASE.replace("--mock-data", f"--data-path 0.6 {a} 0.4 {b} --split 90,10,0 "
                         f"--tokenizer-type NullTokenizer --vocab-size {EOD} "
                         f"--data-cache-path {cache}")
    assert main(shlex.split(flags)) == 0
    out = capsys.readouterr()
    assert "ready in" in out.out and "built in" in out.err
    files = sorted(os.listdir(cache))
    assert sum("BlendedDataset" in f for f in files) == 4  # train and valid, two arrays each
    assert not any(f.endswith(".lock") or ".tmp-" in f for f in files)
    # the run (same data, seed, lengths) only loads: no "built" line, no new file
    cfg = DataConfig(data_path=["0.6", a, "0.4", b], split="90,10,0",
                     data_cache_path=str(cache))
    assert main(shlex.split(flags)) == 0
    assert "built in" not in capsys.readouterr().err and sorted(os.listdir(cache)) == files
    tok = build_tokenizer("NullTokenizer", vocab_size=EOD)
    train = build_gpt_datasets(cfg, tok, (24, 0, 0), seq_length=32, seed=1234)[0]
    assert len(train) == 24


def test_bad_data_file_is_one_line(tmp_path, capsys):
    spec = tmp_path / "splits.json"
    spec.write_text("{")
    flags = BASE.replace("--mock-data", f"--per-split-data-args-path {spec} "
                         "--tokenizer-type NullTokenizer --vocab-size 100")
    assert main(shlex.split(flags)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{spec}: not JSON" in err
