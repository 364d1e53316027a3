"""pretrain_gpt.py-level parity for multi-token prediction: a tiny MoE model with MTP
(dense first layer, MoE second, so the MTP layers are MoE) trains with the single-process
LM, MTP and MoE losses and grad norms (fp32, rel <= 1e-5) under TP=2+SP, PP=2 (MTP on the
last stage with its copy of the word embedding, tied and untied), EP=2 alltoall and
EP=2 x TP=2+SP with the distributed optimizer; a checkpoint saved at one layout loads at
another; bad MTP flags stop in one line."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.model.mtp import MTPLossTracker
from megamoe.moe.losses import MoELossTracker
from tests.distributed import run_distributed
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

EXTRA = ("--train-iters 4 --moe-layer-freq ([0]+[1]) --clip-grad 0.05 --eod-mask-loss "
         "--eval-interval 4 --eval-iters 1")
MOE_KEYS = ("lm loss", "load_balancing_loss", "z_loss", "grad norm")


def _history(extra: str, world_size: int) -> list[dict]:
    """`extra` may hold TIED: the model with its output layer tied to the embedding."""
    MoELossTracker.clear()
    MTPLossTracker.take()
    base = TINY_MOE
    if TIED in extra:
        base, extra = base.replace("--untie-embeddings-and-output-weights ", ""), \
            extra.replace(TIED, "")
    args = parse_args(shlex.split(f"{base} {EXTRA} {extra}"), world_size=world_size)
    return pretrain(args, print_fn=lambda _msg: None).history


def _worker(rank: int, world_size: int, extra: str) -> list[dict]:
    return _history(extra, world_size)


_SINGLE: dict[str, list[dict]] = {}


def _single(extra: str) -> list[dict]:
    if extra not in _SINGLE:
        _SINGLE[extra] = _history(extra, 1)
    return _SINGLE[extra]


def _assert_parity(model: str, layout: str, world_size: int) -> None:
    single = _single(model)
    depths = int(model.split("--mtp-num-layers ")[1].split()[0])
    assert f"mtp_{depths} loss" in single[0]
    keys = MOE_KEYS + tuple(f"mtp_{k + 1} loss" for k in range(depths))
    assert all(h["grad norm"] > 0.05 for h in single)  # clipping is active
    per_rank = run_distributed(_worker, world_size, 300, f"{model} {layout}")
    for hist in per_rank:
        assert len(hist) == len(single) == 4
        for a, b in zip(single, hist):
            for k in keys:
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (k, single, hist)


TP2_SP = "--tensor-model-parallel-size 2 --sequence-parallel"
EP2 = "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
MTP2 = "--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3"
MTP1 = "--mtp-num-layers 1"


def test_mtp_under_pipeline_parallelism_matches_single_process():
    """PP=2, untied output layer: the last stage looks the MTP tokens up in its copy of the
    word embedding, whose gradient joins the first stage's."""
    _assert_parity(MTP2, "--pipeline-model-parallel-size 2", 2)


CP2_DOCS = "--context-parallel-size 2 --reset-attention-mask --reset-position-ids"


@pytest.mark.slow  # (default-set budget: a representative case stays)
def test_mtp_under_context_parallelism_matches_single_process():
    """CP=2 with documents: each depth's shifted targets cross the cp ranks' chunks and the
    depth losses are means over the whole sequence."""
    _assert_parity(f"{MTP2} --reset-attention-mask --reset-position-ids", CP2_DOCS, 2)


TIED = "--tied-output-layer"  # not a flag: _history drops --untie-embeddings-and-output-weights


@pytest.mark.slow
@pytest.mark.parametrize("model, layout, world_size", [
    (MTP2, TP2_SP, 2),
    (MTP1, TP2_SP, 2),
    (MTP1, "--pipeline-model-parallel-size 2", 2),
    (f"{MTP2} {TIED}", "--pipeline-model-parallel-size 2", 2),
    (f"{MTP2} {TIED}", TP2_SP, 2),
    (MTP2, EP2, 2),
    (MTP1, EP2, 2),
    (MTP2, f"{EP2} {TP2_SP} --use-distributed-optimizer", 4),
    (MTP1, f"{EP2} {TP2_SP} --use-distributed-optimizer", 4),
    (MTP2, "--pipeline-model-parallel-size 2 --use-distributed-optimizer", 4),
    (f"{MTP2} --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers 1", TP2_SP, 2),
    (MTP1, "--context-parallel-size 2", 2),
    (MTP2, "--context-parallel-size 2 --cp-comm-type allgather", 2),
    (MTP2, "--context-parallel-size 4", 4),
    (MTP2, f"--context-parallel-size 2 {TP2_SP}", 4),
    (MTP2, "--context-parallel-size 2 --pipeline-model-parallel-size 2", 4),
    (MTP2, f"--context-parallel-size 2 {EP2}", 4),
    (MTP2, "--context-parallel-size 2 --use-distributed-optimizer", 4),
], ids=["tp2sp-D2", "tp2sp-D1", "pp2-D1", "pp2-tied-D2", "tp2sp-tied-D2", "ep2-D2", "ep2-D1",
        "ep2-tp2sp-distopt-D2", "ep2-tp2sp-distopt-D1", "pp2-dp2-distopt-D2",
        "tp2sp-full-recompute-D2", "cp2-D1", "cp2-allgather-D2", "cp4-D2", "cp2-tp2sp-D2",
        "cp2-pp2-D2", "cp2-ep2-D2", "cp2-dp2-distopt-D2"])
def test_mtp_layouts_match_single_process(model, layout, world_size):
    _assert_parity(model, layout, world_size)


@pytest.mark.parametrize("extra, world, message", [
    ("--mtp-num-layers -1", 1, "--mtp-num-layers must be positive, got -1"),
    ("--mtp-num-layers 0", 1, "--mtp-num-layers must be positive, got 0"),
    ("--mtp-num-layers 1 --mtp-loss-scaling-factor -0.1", 1,
     "--mtp-loss-scaling-factor must be >= 0, got -0.1"),
    ("--mtp-num-layers 5 --context-parallel-size 2", 2,
     "--mtp-num-layers 5 must be at most --seq-length / (2 x --context-parallel-size) (4)"),
    ("--mtp-num-layers 1 --pipeline-model-parallel-size 2 "
     "--position-embedding-type learned_absolute", 2,
     "not supported yet: --mtp-num-layers with --pipeline-model-parallel-size > 1 and "
     "--position-embedding-type learned_absolute"),
])
def test_bad_mtp_flags_fail_in_one_line(capsys, extra, world, message):
    assert message in parse_error(capsys, f"{TINY_MOE} --train-iters 1 {extra}", world)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    "--mtp-num-layers 2 --tensor-model-parallel-size 2 --sequence-parallel",
    "--mtp-num-layers 1 --pipeline-model-parallel-size 2",
], ids=["tp2sp", "pp2"])
def test_planner_counts_the_mtp_parameters_each_rank_holds(flags):
    """The memory model's per-stage parameters (MTP on the last stage, with its copy of
    the word embedding under PP) equal what each rank builds (configs/tiny.yaml)."""
    from megamoe.planning import memory as pl
    from tests.tools.test_plan_parallel import _layout, _parameters_worker, _run_config

    args, run = _run_config(flags, 2)
    measured = run_distributed(_parameters_worker, 2, 120, flags)
    pp = args.pipeline_model_parallel_size
    for rank, count in enumerate(measured):
        stage = rank if pp > 1 else 0
        assert count == sum(pl.stage_parameters(run.model, _layout(args), stage))


@pytest.mark.slow
@pytest.mark.parametrize("saved_layout, saved_world, loaded_layout, loaded_world", [
    ("--pipeline-model-parallel-size 2", 2, "", 1),
    (f"{TP2_SP} {EP2} --use-distributed-optimizer", 4, "--pipeline-model-parallel-size 2", 2),
], ids=["pp2-to-single", "ep2-tp2sp-distopt-to-pp2"])
def test_mtp_checkpoint_saved_at_one_layout_resumes_at_another(
        tmp_path, saved_layout, saved_world, loaded_layout, loaded_world):
    """torch_dist: the MTP modules are saved under their single-process names (the last
    stage's copy of the word embedding is not saved: it loads from the embedding); the
    other layout resumes with the losses of the run that never stopped."""
    from megamoe.training.checkpoint import checkpoint_file, read_dist_tensors

    reference = _single(MTP2)
    src = str(tmp_path / "ck")
    saving = f"{MTP2} --exit-interval 2 --save-interval 2 --save {src} {saved_layout}"
    for hist in run_distributed(_worker, saved_world, 300, saving):
        assert len(hist) == 2
    keys = read_dist_tensors(checkpoint_file(src), "model.").keys()
    assert "model.mtp.layers.1.eh_proj.weight" in keys
    assert "model.mtp.layers.0.transformer_layer.mlp.experts.fc1_weight.gate" in keys
    assert not any("shared_output_weight" in k or "mtp_embedding" in k for k in keys)
    loading = f"{MTP2} --load {src} {loaded_layout}"
    resumed = (run_distributed(_worker, loaded_world, 300, loading) if loaded_world > 1
               else [_history(loading, 1)])
    keys = MOE_KEYS + ("mtp_1 loss", "mtp_2 loss")
    for hist in resumed:
        assert len(hist) == 2
        for a, b in zip(reference[2:], hist):
            for k in keys:
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (k, reference, hist)


def test_planner_activations_count_the_last_stage_with_its_mtp_layers():
    """Under PP the MTP layers and their logits sit on the last stage, which holds one
    micro-batch in 1F1B: with enough MTP depths it outweighs the first stage (PP in
    flight), and the estimate is then the last stage's."""
    from megamoe.planning import memory as pl
    from tests.tools.test_plan_parallel import _layout, _run_config

    def estimate(flags: str) -> float:
        args, run = _run_config(f"--pipeline-model-parallel-size 2 {flags}", 2)
        return pl.activation_bytes(run.model, _layout(args), run.model.seq_length)

    args, run = _run_config("--pipeline-model-parallel-size 2 --mtp-num-layers 3", 2)
    lay = _layout(args)
    # (one decoder layer per stage; the last holds 1 micro-batch, the first 2)
    last = pl._stage_activations(run.model, lay, run.model.seq_length, 2, 3, [1], [1])[0]
    first = pl._stage_activations(run.model, lay, run.model.seq_length, 2, 0, [2], [1])[0]
    assert last > first
    assert estimate("--mtp-num-layers 3") == last > estimate("") == first
