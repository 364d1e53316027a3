"""--tp-comm-overlap from the command line: Megatron's rules and sub-flags, the
Transformer-Engine-only flags refused in one line, and a whole tiny MoE model trained at
TP 2 + SP with and without the overlap to the same losses and grad norms."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config.tp_comm_overlap import TPCommOverlap
from tests.distributed import run_distributed
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

TP2 = f"{TINY_MOE} --train-iters 3 --tensor-model-parallel-size 2 --sequence-parallel"


def _overlap(flags: str):
    return run_config_from_args(parse_args(shlex.split(f"{TP2} {flags}"), world_size=2),
                                97).parallel.tp_comm


def test_flags_map_to_the_overlap_and_bad_combinations_are_one_line(capsys):
    assert _overlap("") is None
    assert _overlap("--tp-comm-overlap") == TPCommOverlap()  # Megatron's defaults
    # Megatron's two spellings of each store_false field, and the store_true one
    for spelling in ("--no", "--disable"):
        assert _overlap(f"--tp-comm-overlap {spelling}-tp-comm-overlap-ag "
                        f"{spelling}-tp-comm-overlap-rs {spelling}-tp-comm-bulk-wgrad "
                        f"{spelling}-tp-comm-bulk-dgrad --tp-comm-overlap-rs-dgrad") == \
            TPCommOverlap(ag=False, rs=False, rs_dgrad=True, bulk_wgrad=False,
                          bulk_dgrad=False)
    base = f"{TINY_MOE} --train-iters 1"
    for flags, world, message in (
            # Megatron's assert (it turns SP off at TP 1 first)
            ("--tp-comm-overlap", 1, "--tp-comm-overlap needs --sequence-parallel"),
            ("--tp-comm-overlap --sequence-parallel", 1,
             "--tp-comm-overlap needs --sequence-parallel"),
            ("--tp-comm-overlap --tensor-model-parallel-size 2", 2,
             "--tp-comm-overlap needs --sequence-parallel"),
            # never accepted and ignored
            ("--no-tp-comm-overlap-ag", 1, "--disable-tp-comm-overlap-ag needs "
                                           "--tp-comm-overlap"),
            ("--tp-comm-overlap-rs-dgrad", 1, "--tp-comm-overlap-rs-dgrad needs "
                                              "--tp-comm-overlap"),
            # Transformer Engine's userbuffer settings
            ("--tp-comm-overlap --tensor-model-parallel-size 2 --sequence-parallel "
             "--tp-comm-overlap-cfg ub.yaml", 2, "not supported yet: --tp-comm-overlap-cfg"),
            ("--tp-comm-bootstrap-backend mpi", 1,
             "not supported yet: --tp-comm-bootstrap-backend"),
            ("--no-tp-comm-split-ag", 1, "not supported yet: --no-tp-comm-split-ag"),
            ("--disable-tp-comm-split-rs", 1, "not supported yet: --disable-tp-comm-split-rs"),
            ("--tp-comm-overlap --tensor-model-parallel-size 2 --sequence-parallel "
             "--fp8-format e4m3", 2, "not supported yet: --tp-comm-overlap with --fp8-format")):
        err = parse_error(capsys, f"{base} {flags}", world)
        assert message in err, (flags, err)


def _worker(rank: int, world_size: int, flags: str) -> tuple[list[dict], int]:
    """The run's history and how many ring steps it posted (the flag must reach the
    layers: equal losses alone would not show that)."""
    from megamoe.cli.main import pretrain
    from megamoe.parallel import collective_matmul

    steps = []
    exchange = collective_matmul._exchange

    def counted(*a, **k):
        steps.append(1)
        return exchange(*a, **k)

    collective_matmul._exchange = counted
    args = parse_args(shlex.split(f"{TP2} --moe-layer-freq ([0]+[1]) --clip-grad 0.05 "
                                  f"{flags}"), world_size=world_size)
    return pretrain(args, print_fn=lambda _msg: None).history, len(steps)


@pytest.mark.slow
@pytest.mark.parametrize("flags", ["--tp-comm-overlap",
                                   "--tp-comm-overlap --tp-comm-overlap-rs-dgrad"])
def test_training_with_overlap_matches_without(flags):
    """TP 2 + SP, a dense and an MoE layer, clipping active: the same losses and grad norms
    to rounding (rtol 1e-5: the ring's summation order differs from the reduce-scatter's)."""
    plain, plain_steps = zip(*run_distributed(_worker, 2, 300, ""))
    overlapped, steps = zip(*run_distributed(_worker, 2, 300, flags))
    assert set(plain_steps) == {0} and min(steps) > 0, (plain_steps, steps)
    keys = ("lm loss", "load_balancing_loss", "z_loss", "grad norm")
    for want, got in zip(plain, overlapped):
        assert len(want) == len(got) == 3
        for a, b in zip(want, got):
            for k in keys:
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (k, want, got)
    assert all(h["grad norm"] > 0.05 for h in plain[0])
