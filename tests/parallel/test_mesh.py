"""Mesh: Megatron rank layout (pure function), MoE parallel folding, group creation."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megamoe.config import ConfigError, ParallelConfig
from megamoe.parallel.mesh import build_mesh, rank_groups
from tests.distributed import run_distributed


def test_tp2_pp2_dp2_ep2_etp1_matches_megatron_layout():
    g = rank_groups(ParallelConfig.layout(8, tp=2, pp=2, ep=2, etp=1))
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["tp_dp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embd"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # MoE folding: ETP1 x EP2 x EDP2 x PP2 over the same ranks and pipeline groups.
    assert g["etp"] == [[r] for r in range(8)]
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["tp_ep"] == g["ep"]


def test_every_group_kind_partitions_the_world():
    for sizes in (dict(tp=2, cp=2, pp=2), dict(tp=4, ep=4, etp=1),
                  dict(tp=2, ep=2, etp=2, pp=2), dict()):
        for name, lists in rank_groups(ParallelConfig.layout(16, **sizes)).items():
            flat = sorted(r for lst in lists for r in lst)
            assert flat == list(range(16)), (sizes, name)
            assert len({len(lst) for lst in lists}) == 1, (sizes, name)


def test_cp_sits_between_tp_and_dp_and_etp_defaults_to_tp():
    g = rank_groups(ParallelConfig.layout(8, tp=2, cp=2))
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["tp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["etp"] == g["tp"]
    assert ParallelConfig.layout(8, tp=2, ep=2).sizes()["edp"] == 2


@pytest.mark.parametrize("sizes, message", [
    (dict(tp=3), "world size 8 is not divisible by --tensor-model-parallel-size (3) x "
                 "--pipeline-model-parallel-size (1) x --context-parallel-size (1)"),
    (dict(tp=2, pp=2, ep=4), "world size 8 is not divisible by --expert-tensor-parallel-size "
                             "(2) x --expert-model-parallel-size (4) x "
                             "--pipeline-model-parallel-size (2)"),
    (dict(tp=0), "--tensor-model-parallel-size must be positive, got 0"),
])
def test_bad_layout_names_the_sizes(sizes, message):
    """The layout is validated once, by ParallelConfig, before any group exists."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig.layout(8, **sizes)


def _mesh_worker(rank: int, world_size: int) -> dict:
    mesh = build_mesh(ParallelConfig.layout(2, tp=2, ep=2, etp=1), "gloo")
    members = {n: dist.get_process_group_ranks(g) for n, g in mesh.groups.items()
               if g is not None}
    for name, dims in (("device_mesh", ("pp", "dp", "cp", "tp")),
                       ("expert_device_mesh", ("pp", "edp", "ep", "etp"))):
        dm = getattr(mesh, name)
        assert dm.mesh_dim_names == dims and dm.mesh.flatten().tolist() == [0, 1]
    return {"sizes": mesh.sizes, "ranks": mesh.ranks, "members": members,
            "dp": (mesh.dp_rank, mesh.dp_size), "tp": (mesh.tp_rank, mesh.tp_size),
            "logging": mesh.is_logging_rank}


def test_build_mesh_creates_the_groups_of_the_pure_layout():
    out = run_distributed(_mesh_worker, 2, 60)
    expected = rank_groups(ParallelConfig.layout(2, tp=2, ep=2, etp=1))
    for rank, o in enumerate(out):
        assert o["sizes"] == {"tp": 2, "cp": 1, "pp": 1, "ep": 2, "etp": 1, "dp": 1, "edp": 1}
        assert set(o["members"]) == {"tp", "tp_cp", "tp_dp_cp", "mp", "ep", "tp_ep"}
        for name, members in o["members"].items():
            assert members in expected[name] and rank in members, (name, members)
        assert o["tp"] == (rank, 2) and o["dp"] == (0, 1)
        assert o["ranks"]["edp"] == 0 and o["ranks"]["ep"] == rank and o["ranks"]["etp"] == 0
        assert o["logging"] == (rank == 1)


def test_a_middle_pipeline_stage_has_no_embedding_group():
    """(It holds neither the embedding nor the output layer; the groups are all present.)"""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh = build_mesh(ParallelConfig.layout(4, pp=4), "gloo")
    finally:
        dist.destroy_process_group()
    assert mesh.group("embd") is None and mesh.group_ranks["embd"] == []
    assert mesh.group("pp") is not None and mesh.group_ranks["pp"] == [0, 1, 2, 3]
