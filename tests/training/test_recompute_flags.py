"""The --recompute-* flags: Megatron's meanings, its deprecated spellings, and one clear line
for every combination that would recompute nothing or cannot work."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import ConfigError, RecomputeConfig
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

BASE = f"{TINY_MOE} --train-iters 1"


def _recompute(extra: str) -> RecomputeConfig:
    return run_config_from_args(parse_args(shlex.split(f"{BASE} {extra}"), world_size=1),
                                97).recompute


def test_recompute_activations_is_selective():
    """Megatron: --recompute-activations sets selective granularity (core_attn)."""
    r = _recompute("--recompute-activations")
    assert (r.granularity, r.selected) == ("selective", ("core_attn",))


def test_moe_layer_recompute_adds_moe():
    """Megatron: --moe-layer-recompute is selective with "moe" appended to the modules,
    which default to core_attn first."""
    assert _recompute("--moe-layer-recompute").selected == ("core_attn", "moe")
    r = _recompute("--moe-layer-recompute --recompute-granularity selective "
                   "--recompute-modules moe_act")
    assert r.selected == ("moe_act", "moe")
    assert _recompute("--moe-layer-recompute --recompute-modules moe").selected == ("moe",)


def test_selective_defaults_to_core_attn_and_full_takes_method_and_layers():
    assert _recompute("--recompute-granularity selective").selected == ("core_attn",)
    r = _recompute("--recompute-granularity full --recompute-method block "
                   "--recompute-num-layers 1")
    assert r.full_layers(2) == [[0]] and r.selected == ()
    r = _recompute("--recompute-granularity full --recompute-method uniform "
                   "--recompute-num-layers 2")
    assert r.full_layers(5) == [[0, 1], [2, 3], [4]]
    assert _recompute("").enabled is False
    assert _recompute("--recompute-granularity selective --recompute-modules").enabled is False


@pytest.mark.parametrize("extra, message", [
    ("--recompute-granularity full --recompute-num-layers 1",
     "--recompute-granularity full needs --recompute-method uniform or block"),
    ("--recompute-granularity full --recompute-method uniform",
     "--recompute-granularity full needs --recompute-num-layers"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 0",
     "--recompute-num-layers must be >= 1"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 3",
     "--recompute-num-layers (3) must be at most --num-layers (2)"),
    ("--recompute-granularity selective --recompute-method uniform",
     "--recompute-method is for --recompute-granularity full only"),
    ("--recompute-granularity selective --recompute-num-layers 1",
     "--recompute-num-layers is for --recompute-granularity full only"),
    ("--recompute-method block", "--recompute-method needs --recompute-granularity"),
    ("--recompute-modules moe", "--recompute-modules needs --recompute-granularity"),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 1 "
     "--recompute-modules moe", "--recompute-modules needs --recompute-granularity selective"),
    ("--recompute-granularity selective --recompute-modules attn",
     "--recompute-modules: unknown attn"),
    ("--recompute-granularity selective --recompute-modules mla_up_proj",
     "--recompute-modules mla_up_proj needs multi-latent attention"),
    ("--recompute-granularity selective --recompute-modules shared_experts",
     "--recompute-modules shared_experts needs shared experts"),
    ("--recompute-granularity selective --recompute-modules mlp",
     "--recompute-modules mlp needs dense MLP layers"),
    ("--recompute-activations --recompute-granularity full --recompute-method block "
     "--recompute-num-layers 1", "--recompute-activations means --recompute-granularity "
     "selective"),
    ("--moe-layer-recompute --recompute-granularity full --recompute-method block "
     "--recompute-num-layers 1", "--moe-layer-recompute cannot be combined with"),
])
def test_bad_recompute_flags_fail_in_one_line(capsys, extra, message):
    assert message in parse_error(capsys, f"{BASE} {extra}", 1)


def test_moe_act_needs_grouped_gemm(capsys):
    flags = BASE.replace("--moe-grouped-gemm ", "")
    err = parse_error(capsys, f"{flags} --recompute-granularity selective "
                              "--recompute-modules moe_act", 1)
    assert "--recompute-modules moe_act needs --moe-grouped-gemm" in err


def test_moe_modules_need_moe_layers(capsys):
    dense = BASE.replace("--num-experts 4 ", "")
    err = parse_error(capsys, f"{dense} --recompute-granularity selective "
                              "--recompute-modules moe", 1)
    assert "--recompute-modules moe needs MoE layers" in err


def test_library_users_get_the_same_checks():
    with pytest.raises(ConfigError, match="--recompute-granularity must be full or selective"):
        RecomputeConfig(granularity="partial")
    with pytest.raises(ConfigError, match="--recompute-modules: unknown attn"):
        RecomputeConfig(granularity="selective", modules=["attn"])
