"""Fixtures the Megatron-LM checkpoint tests share: the megatron-core peer's Python (a
cached venv; a peer test that cannot get it skips, or fails in CI) and Megatron-LM saves
written by it on demand."""

from __future__ import annotations

import os

import pytest

from tests.tools.megatron_peer.mcore_venv import PeerUnavailable, peer_python, run_peer


@pytest.fixture(scope="module")
def mcore_python() -> str:
    try:
        return peer_python()
    except PeerUnavailable as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"megatron-core peer unavailable in CI: {e}")
        pytest.skip(f"megatron-core peer unavailable: {e}")


@pytest.fixture(scope="module")
def saves(tmp_path_factory, mcore_python):
    """variant -> a Megatron-LM save directory written by megatron-core (made on demand)."""
    root, made = tmp_path_factory.mktemp("megatron"), {}

    def get(variant: str) -> str:
        if variant not in made:
            out = str(root / variant)
            run_peer(["save", "--variant", variant, "--out", out], python=mcore_python)
            made[variant] = out
        return made[variant]
    return get
