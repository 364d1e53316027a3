"""--compile (megamoe's extension: torch.compile per transformer layer) trains as eager does,
to fp32 rounding: the losses and grad norms of the first step, and (with SGD, whose update
does not amplify rounding the way Adam's normalised one does) of every step, with aux, seq
aux, global aux and z losses, expert bias, dropout and router jitter on; with recompute and
under EP / TP in the slow set."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.training.test_recompute import BALANCING, BIAS, _history

LOSSES = f"{BALANCING} {BIAS}"


def _assert_close(eager: list[dict], compiled: list[dict], rtol: float, what: str = "") -> None:
    assert len(eager) == len(compiled) == 3
    for a, b in zip(eager, compiled):
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k] - b[k]) <= rtol * abs(a[k]) + 1e-9, (what, k, eager, compiled)


def _pair(extra: str, world_size: int = 1) -> tuple[list[dict], list[dict]]:
    return _history(extra, world_size), _history(f"{extra} --compile", world_size)


def _worker(rank: int, world_size: int, extra: str):
    return _history(extra, world_size)


@pytest.mark.slow
def test_compiled_layers_train_as_eager():
    eager, compiled = _pair(f"{LOSSES} --optimizer sgd --lr 0.1")
    _assert_close(eager, compiled, 1e-4, "sgd")


@pytest.mark.slow
def test_compiled_layers_with_adam_match_eager_at_the_first_step():
    eager, compiled = _pair(LOSSES)  # Adam: the first step's numbers, before any update
    _assert_close(eager[:1] * 3, compiled[:1] * 3, 1e-4, "adam")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["recompute", "ep2_alltoall", "tp2_sp"])
def test_compiled_layers_train_as_eager_in_layouts(layout):
    extra = f"{LOSSES} --optimizer sgd --lr 0.1"
    if layout == "recompute":
        eager, compiled = _pair(f"{extra} --recompute-granularity selective "
                                "--recompute-modules moe moe_act layernorm")
        _assert_close(eager, compiled, 1e-4, layout)
        return
    flags = ("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
             if layout == "ep2_alltoall" else "--tensor-model-parallel-size 2 --sequence-parallel")
    # (each run in fresh processes: back-to-back process groups in one process can race)
    eager = run_distributed(_worker, 2, 900, f"{extra} {flags}")
    compiled = run_distributed(_worker, 2, 900, f"{extra} {flags} --compile")
    for rank in range(2):
        _assert_close(eager[rank], compiled[rank], 1e-4, f"{layout} rank {rank}")
