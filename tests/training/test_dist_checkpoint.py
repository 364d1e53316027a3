"""--ckpt-format torch_dist: a checkpoint saved under EP=2 x TP=2 + SP (ETP = TP, shared
experts split over TP) with the distributed optimizer at DP=2 loads under EP=4
(distributed optimizer, DP=4), PP=2 and one process. Each loading layout re-saves what it
loaded: every tensor (weights, Adam states) is bitwise the original, so the logits are
identical and the distributed optimizer's dp shards were re-sliced exactly; training then
continues with the losses of a run that never changed layout."""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.cli.mapping import config_from_args, run_config_from_args
from megamoe.config import DataConfig
from megamoe.data import tokenizer_for
from megamoe.inference import from_checkpoint
from megamoe.parallel.mesh import init_mesh
from megamoe.training.build import build_model
from megamoe.training.checkpoint import (
    checkpoint_file,
    load_dist_checkpoint,
    read_common,
    read_dist_tensors,
    save_dist_checkpoint,
)
from megamoe.training.checkpoint.vocab_padding import keep_checkpoint_vocab_padding
from megamoe.training.optim import build_optimizer
from megamoe.training.schedules.lr import LRScheduler
from tests.distributed import run_distributed
from tests.training.test_pretrain import TINY_MOE as TINY

# With shared experts (and their gate): split over TP since they are Megatron's TP MLP, they
# reshard like the dense MLP (fc1 saved as its gate and up halves).
TINY_MOE = f"{TINY} --moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate"
SHARED_FC1 = "model.decoder.layers.1.mlp.shared_experts.linear_fc1.weight"

SAVED_LAYOUT = ("--tensor-model-parallel-size 2 --sequence-parallel "
                "--expert-model-parallel-size 2 --use-distributed-optimizer "
                "--moe-token-dispatcher-type alltoall")
EP4 = "--expert-model-parallel-size 4 --use-distributed-optimizer"
PP2 = "--pipeline-model-parallel-size 2"
EP2_DISTOPT = "--expert-model-parallel-size 2 --use-distributed-optimizer"


def _losses(extra: str, world_size: int) -> list[float]:
    args = parse_args(shlex.split(f"{TINY_MOE} {extra}"), world_size=world_size)
    return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


def _train_worker(rank: int, world_size: int, extra: str) -> list[float]:
    return _losses(extra, world_size)


def _resave_then_resume(rank: int, world_size: int, layout: str, src: str,
                        dst: str) -> list[float]:
    """Load `src` under `layout`, save it again to `dst` untouched, then resume training."""
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 4 {layout}"),
                      world_size=world_size)
    run = run_config_from_args(args, tokenizer_for(config_from_args(DataConfig, args)).vocab_size)
    mesh = init_mesh(run.parallel)
    # as pretrain does: the checkpoint's padded vocabulary (m x its TP) is kept
    keep_checkpoint_vocab_padding(run.model, src, run.parallel.tensor_model_parallel_size,
                                  lambda _m: None)
    model = build_model(run, mesh)
    optimizer = build_optimizer(model, run.optim, mesh=mesh,
                                distributed=run.parallel.use_distributed_optimizer)
    scheduler = LRScheduler(optimizer, run.optim, run.train.train_iters)
    common = load_dist_checkpoint(checkpoint_file(src), model, optimizer, scheduler, mesh)
    save_dist_checkpoint(dst, common["iteration"], model, optimizer, scheduler, mesh,
                         common["consumed_train_samples"], {},
                         model_config=common["model_config"])
    return _losses(f"--train-iters 4 --load {src} {layout}", world_size)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """The reference run (one process, 4 iterations) and the EP2 x TP2 checkpoint at 2."""
    root = tmp_path_factory.mktemp("dist_ckpt")
    reference = _losses("--train-iters 4", 1)
    src = str(root / "ep2_tp2")
    per_rank = run_distributed(_train_worker, 4, 300, f"--train-iters 4 --exit-interval 2 "
                               f"--save-interval 2 --save {src} {SAVED_LAYOUT}")
    for losses in per_rank:
        _close(losses, reference[:2])
    return {"root": root, "src": src, "reference": reference}


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b)), (a, b)


def _check_resharded(saved: dict, dst: str, resumed: list[list[float]]) -> None:
    original = read_dist_tensors(checkpoint_file(saved["src"]))
    again = read_dist_tensors(checkpoint_file(dst))
    assert original.keys() == again.keys()
    assert original[f"{SHARED_FC1}.gate"].shape == original[f"{SHARED_FC1}.up"].shape == (32, 32)
    assert any(k.startswith("optimizer.") and k.endswith("exp_avg_sq") for k in original)
    for key, t in original.items():
        assert torch.equal(t, again[key]), key
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_checkpoint(saved["src"])(tokens), from_checkpoint(dst)(tokens))
    for losses in resumed:
        _close(losses, saved["reference"][2:])


@pytest.mark.slow
def test_expert_parallel_checkpoint_loads_under_ep4(saved):
    dst = str(saved["root"] / "ep4")
    resumed = run_distributed(_resave_then_resume, 4, 300, EP4, saved["src"], dst)
    _check_resharded(saved, dst, resumed)


def test_expert_parallel_checkpoint_loads_in_one_process(saved):
    """Also the DP=2 distributed optimizer -> DP=1 plain optimizer: states match."""
    dst = str(saved["root"] / "single")
    resumed = [_resave_then_resume(0, 1, "", saved["src"], dst)]
    _check_resharded(saved, dst, resumed)
    single = str(saved["root"] / "single_run")
    _losses(f"--train-iters 4 --exit-interval 2 --save {single}", 1)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the same model trained in one process: logits to rounding
        a, b = from_checkpoint(saved["src"])(tokens), from_checkpoint(single)(tokens)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_expert_parallel_checkpoint_loads_under_pp2(saved):
    dst = str(saved["root"] / "pp2")
    resumed = run_distributed(_resave_then_resume, 2, 300, PP2, saved["src"], dst)
    _check_resharded(saved, dst, resumed)


def _untied(flags: str) -> str:
    return flags.replace("--untie-embeddings-and-output-weights ", "")


def _tied_worker(rank: int, world_size: int, extra: str) -> list[float]:
    args = parse_args(shlex.split(f"{_untied(TINY_MOE)} {extra}"), world_size=world_size)
    return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


@pytest.mark.slow
def test_tied_embeddings_pipeline_checkpoint_loads_in_one_process(tmp_path):
    """PP=2 with tied embeddings: the last stage's copy is saved once (as the embedding)
    and the single-process model resumes with the unchanged run's losses."""
    reference = _tied_worker(0, 1, "--train-iters 4")
    src = str(tmp_path / "pp2")
    for losses in run_distributed(_tied_worker, 2, 300, f"--train-iters 4 --exit-interval 2 "
                                  f"--save-interval 2 --save {src} {PP2}"):
        _close(losses, reference[:2])
    _close(_tied_worker(0, 1, f"--train-iters 4 --load {src}"), reference[2:])
    keys = read_dist_tensors(checkpoint_file(src), "model.").keys()
    assert "model.embedding.word_embeddings.weight" in keys
    assert not any("output" in k for k in keys)


def test_torch_dist_from_checkpoint_path_forms_and_bf16_resume(tmp_path):
    """Root or iter dir; the same logits as the single-file format of the same run; a bf16
    run (fp32 main params saved apart from the bf16 weights) resumes bitwise."""
    dist_dir, file_dir = tmp_path / "dist", tmp_path / "file"
    _losses(f"--train-iters 2 --save {dist_dir}", 1)
    _losses(f"--train-iters 2 --save {file_dir} --ckpt-format torch", 1)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = from_checkpoint(str(file_dir))(tokens)
        for path in (dist_dir, dist_dir / "iter_0000002"):
            assert torch.equal(from_checkpoint(str(path))(tokens), want)
    bf16 = "--bf16 --train-iters 4"
    straight = _losses(bf16, 1)
    first = _losses(f"{bf16} --exit-interval 2 --save {tmp_path / 'bf16'}", 1)
    assert any(k.endswith(".main") for k in read_dist_tensors(
        checkpoint_file(str(tmp_path / "bf16")), "optimizer."))
    second = _losses(f"{bf16} --load {tmp_path / 'bf16'}", 1)
    assert first + second == straight


def test_wrong_shape_names_the_tensor(tmp_path):
    """Without a saved model config to compare flags with, DCP's own index catches it."""
    from megamoe.training.checkpoint import CheckpointError

    save = tmp_path / "run"
    _losses(f"--train-iters 1 --save {save}", 1)
    found = checkpoint_file(str(save))
    common = dict(read_common(found), model_config=None)
    args = parse_args(shlex.split(f"{TINY_MOE} --num-experts 8 --train-iters 1"), world_size=1)
    model = build_model(run_config_from_args(args, 98))
    with pytest.raises(CheckpointError, match=r"iter_0000001: does not match the model \("
                       r"model.decoder.layers.0.mlp.router.weight has shape \[4, 32\] in the "
                       r"checkpoint, \[8, 32\] in this model\)"):
        load_dist_checkpoint(found, model, None, None, None, common=common)


@pytest.mark.slow
def test_async_save_on_data_parallel_ranks_matches_blocking(tmp_path):
    """DCP's background writes (their own gloo group) while the ranks keep training."""
    flags = "--train-iters 3 --save-interval 1 --use-distributed-optimizer"
    run_distributed(_train_worker, 2, 300, f"{flags} --save {tmp_path / 'sync'}")
    run_distributed(_train_worker, 2, 300, f"{flags} --async-save --save {tmp_path / 'async'}")
    for it in (1, 2, 3):
        a = read_dist_tensors(str(tmp_path / "sync" / f"iter_000000{it}"))
        b = read_dist_tensors(str(tmp_path / "async" / f"iter_000000{it}"))
        assert a.keys() == b.keys()
        for k, v in a.items():
            assert torch.equal(v, b[k]), (it, k)
        # the common state is this iteration's too (async saves publish it later)
        ca, cb = (read_common(str(tmp_path / d / f"iter_000000{it}"))
                  for d in ("sync", "async"))
        assert torch.equal(ca["optimizer"]["step"], cb["optimizer"]["step"]), it
        assert float(cb["optimizer"]["step"]) == it and ca["scheduler"] == cb["scheduler"]
        assert ca["consumed_train_samples"] == cb["consumed_train_samples"]
        for ra, rb in zip(ca["rng"], cb["rng"], strict=True):
            assert torch.equal(ra["torch"], rb["torch"]), it


@pytest.mark.slow
def test_bf16_distributed_optimizer_states_reshard_bitwise(tmp_path):
    """bf16 with the distributed optimizer at DP=4 (each parameter and its fp32 main and
    Adam states saved by one dp rank, those crossing a shard end assembled there) loads
    under EP=2 x DP=2 (experts sharded over edp = 2) and re-saves every tensor bitwise."""
    src, dst = str(tmp_path / "dp4"), str(tmp_path / "ep2")
    run_distributed(_train_worker, 4, 300, f"--bf16 --use-distributed-optimizer "
                    f"--train-iters 2 --save-interval 2 --save {src}")
    run_distributed(_resave_then_resume, 4, 300, f"--bf16 {EP2_DISTOPT}", src, dst)
    original = read_dist_tensors(checkpoint_file(src))
    again = read_dist_tensors(checkpoint_file(dst))
    assert original.keys() == again.keys()
    assert any(k.startswith("optimizer.") and k.endswith(".main") for k in original)
    for key, t in original.items():
        assert torch.equal(t, again[key]), key
