"""--data-args-path / --per-split-data-args-path: blends read from files, as Megatron."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from megamoe.config import DataConfig
from megamoe.data import BlendedDataset, DataError, build_gpt_datasets, build_tokenizer
from megamoe.data.data_args import read_per_split_data_args
from tests.data.test_blended_dataset import _corpus
from tests.flags import parse_error
from tests.test_arguments import BASE

EOD = 5000


def _tokens(ds):
    return [ds[i]["tokens"].tolist() for i in range(len(ds))] if ds is not None else None


def _build(tmp_path, **kw):
    tok = build_tokenizer("NullTokenizer", vocab_size=EOD)
    cfg = DataConfig(split="90,10,0", data_cache_path=str(tmp_path / "cache"), **kw)
    datasets = build_gpt_datasets(cfg, tok, (60, 10, 10), seq_length=8, seed=7)
    # DataLoader workers get pickled datasets: cached indices travel as paths, not copies
    again = pickle.loads(pickle.dumps(datasets))
    for d in again:
        if isinstance(d, BlendedDataset):
            assert isinstance(d.dataset_index, np.memmap)
    out = [_tokens(d) for d in datasets]
    assert out == [_tokens(d) for d in again]
    return out


def test_data_args_file_equals_data_path(tmp_path):
    a = _corpus(tmp_path / "a", 1000, 30, EOD)
    b = _corpus(tmp_path / "b", 3000, 30, EOD)
    args = tmp_path / "blend.txt"
    args.write_text(f"0.7 {a}\n0.3\t{b}\n")
    assert _build(tmp_path, data_args_path=str(args)) == \
        _build(tmp_path, data_path=["0.7", a, "0.3", b])


def test_per_split_file_equals_per_split_flags(tmp_path):
    a = _corpus(tmp_path / "a", 1000, 30, EOD)
    b = _corpus(tmp_path / "b", 3000, 30, EOD)
    spec = tmp_path / "splits.json"
    spec.write_text(json.dumps({"train": f"1 {a} 2 {b}", "valid": [b], "test": None}))
    got = _build(tmp_path, per_split_data_args_path=str(spec))
    want = _build(tmp_path, train_data_path=["1", a, "2", b], valid_data_path=[b])
    assert got == want and got[2] is None and np.size(got[1]) > 0


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"),
    ('{"train": "x", "valid": null}', 'keys "train", "valid" and "test"'),
    ('["x"]', 'keys "train"'),
    ('{"train": {"a": 1}, "valid": null, "test": null}', '"train" must be'),
    ('{"train": [], "valid": null, "test": null}', '"train" must be'),
    ('{"train": "a", "valid": [true], "test": null}', '"valid" must be'),
])
def test_bad_per_split_file_names_it(tmp_path, text, message):
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(DataError, match=message) as e:
        read_per_split_data_args(str(path))
    assert str(e.value).startswith(str(path))


def test_empty_data_args_file(tmp_path):
    (tmp_path / "e.txt").write_text(" \n")
    with pytest.raises(DataError, match="e.txt: --data-args-path file is empty"):
        _build(tmp_path, data_args_path=str(tmp_path / "e.txt"))


def test_flags(capsys, tmp_path):
    base = BASE.replace("--mock-data", "--tokenizer-type NullTokenizer --vocab-size 100")
    (tmp_path / "f").write_text("x")
    f = tmp_path / "f"
    assert "--data-args-path: file not found" in parse_error(
        capsys, f"{base} --data-args-path {tmp_path}/nope", 1)
    assert "--data-args-path and --data-path are mutually exclusive" in parse_error(
        capsys, f"{base} --data-args-path {f} --data-path {f}", 1)
    assert "--per-split-data-args-path and --train-data-path" in parse_error(
        capsys, f"{base} --per-split-data-args-path {f} --train-data-path {f}", 1)
    assert "--mock-data cannot be combined" in parse_error(
        capsys, f"{BASE} --per-split-data-args-path {f}", 1)
