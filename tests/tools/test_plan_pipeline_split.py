"""The planner's uneven pipeline splits (megamoe/planning/pipeline_balance.py): a layer
count PP does not divide gets Megatron's --decoder-first/last-pipeline-num-layers split
whose busiest rank does the least work, costed and emitted in the launch line, and that
launch line passes pretrain_gpt.py --dry-run."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from megamoe.model.flops import flops_per_token
from megamoe.planning.pipeline_balance import (
    best_first_last,
    first_last_flags,
    first_last_split,
    imbalance,
    rank_flops,
)
from tests.tools.test_plan_parallel import ROOT, pl

DEEPSEEK = os.path.join(ROOT, "configs", "deepseek-v3.yaml")


def test_deepseek_v3_61_layers_at_pp8_and_pp16():
    """The last rank also runs the output layer and the MTP depth: the balanced split gives
    it fewer layers (61 = 7 x 8 + 5 at PP8; 15 x 4 + 1 at PP16)."""
    model = pl.load_model(DEEPSEEK, 129280, None)
    assert best_first_last(model, 8) == (8,) * 7 + (5,)
    assert first_last_flags((8,) * 7 + (5,)) == ["--decoder-last-pipeline-num-layers=5"]
    assert best_first_last(model, 16) == (4,) * 15 + (1,)
    # the per-rank FLOPs add up to the whole model's (model/flops.py, an independent sum)
    work = rank_flops(model, 8, 1, (8,) * 7 + (5,))
    assert sum(work) == pytest.approx(flops_per_token(model), rel=1e-12)
    # no other legal first/last split at PP8 has a less busy busiest rank
    for first in (None, *range(1, 20)):
        for last in (None, *range(1, 20)):
            split = first_last_split(61, 8, first, last)
            if split is not None:
                assert imbalance(model, 8, 1, split) >= imbalance(model, 8, 1, (8,) * 7 + (5,))


def test_first_last_flags_round_trip():
    assert first_last_flags((3, 5)) == ["--decoder-first-pipeline-num-layers=3"]
    assert first_last_flags((2, 4, 4, 1)) == ["--decoder-first-pipeline-num-layers=2",
                                              "--decoder-last-pipeline-num-layers=1"]


def test_planner_proposes_uneven_splits_that_launch(capsys, monkeypatch):
    """Tiny preset with 7 layers on 4 GPUs: PP2 / PP4 have no even split; the planner
    proposes the balanced first/last split, and its flags pass --dry-run."""
    from megamoe.cli.main import main as pretrain_main
    from tests.tools.test_plan_parallel import _run_config

    _, run = _run_config("--num-layers 7", 1)
    layouts = pl.legal_layouts(run.model, 4, 16, run.model.seq_length, 4)
    uneven = [lay for lay in layouts if lay.split is not None]
    assert {lay.pp for lay in uneven} == {2, 4}
    assert all(lay.pp == 1 for lay in layouts if lay.split is None)
    lay = uneven[0]
    flags = pl.layout_flags(run.model, lay)
    assert any(f.startswith("--decoder-") for f in flags)
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = ["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--num-layers", "7",
            "--dry-run", "--json", "--global-batch-size", "16", "--vocab-size", "256",
            "--mock-data",
            *shlex.split(" ".join(flags))]
    try:
        rc = pretrain_main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["parameters"] > 0
