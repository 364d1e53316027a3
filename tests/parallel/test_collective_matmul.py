"""--tp-comm-overlap's collective matmul (parallel/collective_matmul.py) against the plain
sequence-parallel layers and the dense layers, forward and gradients, and its ring traffic
under NCCL's issue-order matching.

Tolerance: fp32, rtol 1e-5 / atol 1e-6 (the dense-vs-TP tolerance of
test_tensor_parallel.py): the ring adds the partial sums in ring order, the
reduce-scatter in its own, so the two agree to rounding, not bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megamoe.config.tp_comm_overlap import TPCommOverlap
from megamoe.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel
from tests.distributed import run_distributed
from tests.parallel.test_tensor_parallel import _column, _row
from tests.training import test_p2p_order as p2p

META = torch.device("meta")
TOL = dict(rtol=1e-5, atol=1e-6)
VARIANTS = [TPCommOverlap(),  # Megatron's defaults: ag, rs, bulk wgrad + dgrad
            TPCommOverlap(rs_dgrad=True),
            TPCommOverlap(ag=False, rs=False, bulk_wgrad=False, bulk_dgrad=False)]


def _pair(n: int, r: int, group, cfg: TPCommOverlap, s: int = 8, b: int = 3, h: int = 6,
          f: int = 8) -> None:
    """Column then row linear, with and without the overlap (same weights and inputs):
    outputs and every gradient agree."""
    outs = []
    for overlap in (None, cfg):
        tp = TensorParallel(group, sequence_parallel=True, overlap=overlap)
        torch.manual_seed(0)
        col = ColumnParallelLinear(h, f, bias=True, init_std=0.1, tp=tp)
        row = RowParallelLinear(f, h, bias=True, init_std=0.1, tp=tp)
        with torch.no_grad():
            col.bias.normal_(generator=torch.Generator().manual_seed(3))
            row.bias.normal_(generator=torch.Generator().manual_seed(4))
        x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1)).chunk(n)[r]
        x = x.clone().requires_grad_(True)
        y = row(torch.nn.functional.gelu(col(x)))
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + r))
        (y * g).sum().backward()
        outs.append([y.detach(), x.grad] + [p.grad for p in (*col.parameters(),
                                                             *row.parameters())])
    for i, (want, got) in enumerate(zip(*outs)):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, i=i: f"{cfg} tensor {i}: {m}")


def overlap_checks(rank: int, world_size: int) -> None:
    """Every variant against the plain layers, the default one against the dense layers
    too (run at TP 2 inside test_tensor_parallel.py's spawn, which costs the default suite
    no second process start; at TP 4 below)."""
    group = dist.group.WORLD
    for cfg in VARIANTS:
        _pair(world_size, rank, group, cfg)
    tp = TensorParallel(group, sequence_parallel=True, overlap=VARIANTS[0])
    _column(tp, rank, world_size)  # against the dense layers
    if world_size == 2:  # (_row's shapes are TP 2's)
        _row(tp, rank, world_size)


@pytest.mark.slow
def test_overlapped_layers_match_plain_and_dense_tp4():
    run_distributed(overlap_checks, 4, 180)


def _record(n: int, cfg: TPCommOverlap) -> dict[int, list[tuple]]:
    """Every rank's posts and waits for one forward + backward of the column/row pair,
    recorded with test_p2p_order's recorder (fake process group: the collectives do
    nothing, received buffers get random values). The layers and input live on "meta", the
    stand-in accelerator of test_fake_device.py, the default device staying the CPU: a
    buffer made without its input's device fails the recorder's check or mixes devices in
    a GEMM, and a host read of a value (none may be made) raises."""
    rec = p2p.Recorder()
    with pytest.MonkeyPatch.context() as mp:
        for module in (dist, p2p.c10d):
            for name in ("batch_isend_irecv", "isend", "irecv", "send", "recv"):
                mp.setattr(module, name, getattr(rec, name))
        for rank in range(n):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
            try:
                rec.rank, rec.param, rec.programs[rank] = rank, (torch.float32, META), []
                tp = TensorParallel(dist.group.WORLD, sequence_parallel=True, overlap=cfg)
                col = ColumnParallelLinear(4, 12, bias=True, init_std=0.1, tp=tp).to(META)
                row = RowParallelLinear(12, 4, bias=False, init_std=0.1, tp=tp).to(META)
                x = torch.randn(2, 3, 4, device=META, requires_grad=True)
                row(col(x)).sum().backward()
            finally:
                dist.destroy_process_group()
    return rec.programs


def assert_matched_per_direction(programs: dict[int, list[tuple]]) -> None:
    """NCCL's matching: the k-th send a posts to b meets the k-th receive b posts from a;
    they must agree in shape, dtype and tag. (test_p2p_order's assert_mirrored also wants
    the two directions interleaved alike, which holds for the pipeline's schedules but not
    for a ring step, where both neighbours post [send, receive].)"""
    seqs = p2p.pair_sequences(programs)
    for (a, b), mine in seqs.items():
        sends = [op for op in mine if op.kind == "send"]
        recvs = [op for op in seqs.get((b, a), []) if op.kind == "recv"]
        assert len(sends) == len(recvs), f"{a}->{b}: {len(sends)} sends, {len(recvs)} receives"
        for i, (x, y) in enumerate(zip(sends, recvs)):
            assert (x.shape, x.dtype, x.tag) == (y.shape, y.dtype, y.tag), (a, b, i, x, y)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_traffic_is_mirrored_and_completes_under_nccl_matching(n):
    """Every pair's sends and receives match one to one in issue order (shape, dtype,
    tag), and test_p2p_order's NCCL-like rendezvous runs every rank to the end."""
    for cfg in VARIANTS[:2]:
        programs = _record(n, cfg)
        sends = sum(op.kind == "send" for prog in programs.values() for e in prog
                    if e[0] == "post" for op in e[2])
        # per rank, n - 1 steps of each ring: column fwd ag, row fwd rs, row bwd ag, and
        # the column dgrad rs with rs_dgrad
        assert sends == n * (n - 1) * (4 if cfg.rs_dgrad else 3)
        assert_matched_per_direction(programs)
        p2p.simulate(programs)
