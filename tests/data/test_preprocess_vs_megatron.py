"""Byte-identical .bin/.idx against Megatron-LM's own tools/preprocess_data.py (the pinned
commit's script run by the megatron-core peer venv), for a generated multi-MB jsonl and a
Parquet copy of it, through tools/bench_preprocess.py. Slow: Megatron's script imports
megatron.training (tens of seconds on this machine) and tokenizes one document at a time.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

from tools import bench_preprocess

pytestmark = pytest.mark.slow


def _peer_or_skip() -> str:
    from tests.tools.megatron_peer.mcore_venv import PeerUnavailable, peer_python

    if not os.path.isdir(bench_preprocess.parse_args([]).git_dir):
        pytest.skip("no Megatron-LM mirror to run its tools/preprocess_data.py from")
    try:
        py = peer_python()
    except PeerUnavailable as e:
        pytest.skip(f"megatron-core peer venv unavailable: {e}")
    probe = subprocess.run([py, "-c", "import transformers, tokenizers"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("the peer venv lacks transformers/tokenizers (Megatron's "
                    "HuggingFaceTokenizer needs them): pip install them into that venv")
    return py


def test_identical_to_megatron_preprocess_data(tmp_path):
    assert importlib.util.find_spec("pyarrow") is not None
    py = _peer_or_skip()
    args = bench_preprocess.parse_args(["--corpus-mb", "2", "--repeats", "1",
                                        "--memory-mb", "0", "--peer-python", py])
    result = bench_preprocess.bench(args, str(tmp_path))
    assert result["tokens"] > 100_000
    assert result["identical_jsonl"] and result["identical_parquet"], result
