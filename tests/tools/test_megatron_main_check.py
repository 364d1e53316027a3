"""megatron_main_check: the main parameters read from rebuilt flat buffers must be the
saved weights (the peer cases that exercise it on real megatron-core saves are in
test_convert_megatron_dp_reshard.py and test_convert_megatron_te_grouped_optim.py)."""

from __future__ import annotations

import importlib

import torch

from tools.checkpoint.convert import main as _convert  # noqa: F401  (puts tools/checkpoint on sys.path)

check = importlib.import_module("megatron_main_check")


def test_fp32_main_cast_to_bf16_is_the_weight():
    """Megatron's bf16 weights are its fp32 main parameters rounded (copy_ rounds to
    nearest even, as .to does): equal after the cast, not before."""
    main = {"a": torch.tensor([1.0 + 2**-10, -3.0, 0.1]), "b": torch.ones(2, 3)}
    weights = {k: v.to(torch.bfloat16) for k, v in main.items()}
    assert check.main_params_differ(main, weights) is None


def test_a_parameter_read_at_another_range_is_named():
    """Two same-shaped parameters swapped (what a wrong registration order reads): the
    first one by name is reported, with how far off it is."""
    main = {"a": torch.zeros(4), "b": torch.ones(4)}
    weights = {"a": torch.ones(4), "b": torch.zeros(4)}
    msg = check.main_params_differ(main, weights)
    assert msg.startswith("a: the main parameters read from the buffers are not the saved "
                          "weights (max difference 1)")
    assert check.main_params_differ({"c": torch.zeros(4)}, weights).startswith(
        "c: no saved weight")
    assert check.main_params_differ({"a": torch.zeros(2, 2)}, weights).startswith("a: no")
