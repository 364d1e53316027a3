"""The Megatron flags the MoE example scripts pass, with Megatron's meaning: manual GC,
--no-mmap-bin-files, --logging-level, timers, --attention-backend, forced load balancing,
checkpoint format detection and strictness, deprecated spellings, declared equivalents and
--transformer-impl transformer_engine without TE installed."""

from __future__ import annotations

import gc
import logging
import os
import shlex

import numpy as np
import pytest
import torch

from megamoe.cli import main as cli_main
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.cli.mapping import run_config_from_args
from megamoe.model.gpt_model import GPTModel
from megamoe.training.checkpoint import CheckpointError
from megamoe.training.checkpoint.dist import load_dist_checkpoint
from megamoe.training.manual_gc import ManualGC
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE


def _args(extra: str, world_size: int = 1):
    return parse_args(shlex.split(f"{TINY_MOE} {extra}"), world_size=world_size)


# --- declared equivalents, deprecated spellings, logging level, TE ---------------------------

def test_declared_equivalents_print_what_runs():
    """Each equivalent prints one line saying what megamoe runs; flex runs alltoall."""
    flags = ("--moe-permute-fusion --moe-router-fusion --cross-entropy-loss-fusion "
             "--te-rng-tracker --enable-experimental --moe-token-dispatcher-type flex "
             "--moe-flex-dispatcher-backend hybridep --ckpt-fully-parallel-load")
    args = _args(f"--train-iters 1 --dry-run {flags}")
    assert args.moe_token_dispatcher_type == "alltoall"
    out: list[str] = []
    pretrain(args, print_fn=out.append)
    lines = [s for s in out if s.startswith("> --")]
    assert len(lines) == 7, lines
    for flag in ("--moe-permute-fusion", "--moe-router-fusion", "--cross-entropy-loss-fusion",
                 "--te-rng-tracker", "--enable-experimental", "--ckpt-fully-parallel-load"):
        assert sum(s.startswith(f"> {flag}:") for s in lines) == 1, flag
    assert any("hybridep" in s and "alltoall dispatcher runs" in s for s in lines)
    assert not [s for s in _lines_of("--train-iters 1 --dry-run") if s.startswith("> --")]


def _lines_of(extra: str) -> list[str]:
    out: list[str] = []
    pretrain(_args(extra), print_fn=out.append)
    return out


def test_use_rotary_position_embeddings():
    base = TINY_MOE.replace("--position-embedding-type rope ", "")
    args = parse_args(shlex.split(f"{base} --train-iters 1"), world_size=1)
    assert args.position_embedding_type == "learned_absolute"
    args = parse_args(shlex.split(f"{base} --train-iters 1 --use-rotary-position-embeddings"),
                      world_size=1)
    assert run_config_from_args(args, 97).model.position_embedding_type == "rope"


def test_logging_level(monkeypatch, capsys):
    root = logging.getLogger()
    before = root.level
    try:
        argv = shlex.split(f"{TINY_MOE} --train-iters 1 --dry-run --logging-level 40")
        assert cli_main.main(argv) == 0
        assert root.level == 40
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "10")
        assert cli_main.main(argv[:-2]) == 0
        assert root.level == 10
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "loud")
        assert cli_main.main(argv[:-2]) == 2
        assert "MEGATRON_LOGGING_LEVEL" in capsys.readouterr().err
    finally:
        root.setLevel(before)
    parse_error(capsys, f"{TINY_MOE} --train-iters 1 --logging-level -1", 1)


def test_local_rank_must_be_local_rank(monkeypatch, capsys):
    """--local-rank (torch.distributed.launch passes it; Megatron's default is LOCAL_RANK):
    accepted when it is LOCAL_RANK, from which megamoe takes the GPU; else one line."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _args("--train-iters 1 --local-rank 0").local_rank == 0
    assert "LOCAL_RANK is not set" in parse_error(
        capsys, f"{TINY_MOE} --train-iters 1 --local-rank 1", 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _args("--train-iters 1 --local-rank 1").local_rank == 1
    assert "--local-rank 0 disagrees with LOCAL_RANK=1" in parse_error(
        capsys, f"{TINY_MOE} --train-iters 1 --local-rank 0", 1)


def test_transformer_engine_without_te_is_one_line(capsys):
    """The dry run sizes TE's layers as local's; a real run needs TE importable (this
    machine has none: tests/training/test_transformer_engine_training.py runs it on the
    stand-in) and says so in one line, exit 1, before anything is built."""
    argv = shlex.split(f"{TINY_MOE} --train-iters 1 --transformer-impl transformer_engine")
    assert cli_main.main(argv + ["--dry-run"]) == 0
    capsys.readouterr()
    assert cli_main.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the Python package transformer_engine" in err
    assert "Traceback" not in err


def test_fsdp_and_profiling_are_refused(capsys):
    for flags, named in (("--use-megatron-fsdp", "--use-megatron-fsdp"),
                         ("--ckpt-format fsdp_dtensor", "--ckpt-format fsdp_dtensor"),
                         ("--data-parallel-sharding-strategy optim_grads_params",
                          "--data-parallel-sharding-strategy"),
                         ("--tp-comm-overlap-cfg tp.yaml", "--tp-comm-overlap-cfg"),
                         ("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te",
                          "--cross-entropy-fusion-impl te"),
                         ("--timing-log-level 2", "--timing-log-level 2")):
        err = parse_error(capsys, f"{TINY_MOE} --train-iters 1 {flags}", 1)
        assert f"not supported yet: {named}" in err or (
            "te" in named and "disabled in Megatron-LM" in err), err


# --- manual GC ----------------------------------------------------------------------------------

def _megatron_gc_points(iterations: int, interval: int, eval_interval: int, eval_gc: bool):
    """Transcription of Megatron's training.py: gc.collect() at the start of train(); after
    each iteration divisible by manual_gc_interval (if non-zero); with manual_gc_eval a full
    collection before and a generation-0 one after each evaluation."""
    points = [("start", None)]
    for it in range(1, iterations + 1):
        if interval != 0 and it % interval == 0:
            points.append((it, None))
        if it % eval_interval == 0 and eval_gc:
            points += [("eval", None), ("eval", 0)]
    return points


@pytest.mark.parametrize("interval,eval_gc", [(2, True), (0, False)])
def test_manual_gc_points_match_megatron(interval, eval_gc):
    run = run_config_from_args(_args(f"--train-iters 5 --manual-gc --manual-gc-interval "
                                     f"{interval}" + ("" if eval_gc else " --no-manual-gc-eval")),
                               97)
    calls: list = []
    where = ["start"]
    enabled_inside: list[bool] = []

    def collect(generation=None):
        calls.append((where[0], generation))
        enabled_inside.append(gc.isenabled())
        return 0

    was = gc.isenabled()
    with ManualGC(run.train, collect) as c:
        for it in range(1, 6):
            where[0] = it
            c.after_step(it)
            if it % 3 == 0:
                where[0] = "eval"
                c.before_eval()
                c.after_eval()
    assert calls == _megatron_gc_points(5, interval, 3, eval_gc)
    assert enabled_inside and not any(enabled_inside)
    assert gc.isenabled() == was


def test_manual_gc_in_training(monkeypatch):
    seen: list[bool] = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a, **k: seen.append(gc.isenabled()) or real())
    pretrain(_args("--train-iters 4 --manual-gc --manual-gc-interval 2"), print_fn=lambda _: None)
    assert len(seen) == 3 and not any(seen)  # start, iterations 2 and 4; collector off
    assert gc.isenabled()


# --- --no-mmap-bin-files ------------------------------------------------------------------------

def test_no_mmap_bin_files_reads_the_same_tokens(tmp_path):
    import pickle

    from megamoe.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    prefix = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n in (5, 1, 17, 3):
        builder.add_item(rng.integers(0, 60000, n))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap_bin=False)
    assert read._bin_map is None and isinstance(mapped._bin_map, np.memmap)
    for i in range(len(mapped)):
        assert np.array_equal(mapped[i], read[i])
        assert not isinstance(read[i], np.memmap)
    assert np.array_equal(mapped.get(2, 4, 9), read.get(2, 4, 9))
    assert mapped.max_token_id() == read.max_token_id()
    again = pickle.loads(pickle.dumps(read))
    assert again._bin_map is None and np.array_equal(again[2], mapped[2])
    # the flag reaches the datasets a run builds: the same samples, no map of the .bin
    from megamoe.config import DataConfig
    from megamoe.data.builder import build_gpt_datasets
    from megamoe.data.tokenizers import NullTokenizer

    maps: list[str] = []
    real_memmap = np.memmap

    def memmap(path, *a, **k):
        maps.append(str(path))
        return real_memmap(path, *a, **k)

    samples = {}
    for flag in (True, False):
        config = DataConfig(data_path=[prefix], split="100,0,0", mmap_bin_files=flag,
                            tokenizer_type="NullTokenizer", vocab_size=60001)
        maps.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(np, "memmap", memmap)
            train, _, _ = build_gpt_datasets(config, NullTokenizer(60001), (3, 0, 0),
                                             seq_length=4, seed=1)
            samples[flag] = [train[i]["tokens"].tolist() for i in range(3)]
        assert any(p.endswith(".bin") for p in maps) == flag
    assert samples[True] == samples[False]


# --- forced load balancing ----------------------------------------------------------------------

def test_force_load_balancing_routes_by_noise_with_straight_through_gradient():
    """Megatron's RandomSTE: the routing ignores the gate weights (two routers with
    different weights route alike from the same stream), loads come out even, and the
    gate gets the gradient of the noise logits passed straight through."""
    from megamoe.moe.router import TopKRouter
    from megamoe.parallel.rng import RNGTracker

    run = run_config_from_args(_args("--train-iters 1 --moe-router-force-load-balancing"), 97)
    moe, hidden = run.model.moe, run.model.hidden_size
    torch.manual_seed(0)
    a, b = (TopKRouter(hidden, moe, 1, 2, std) for std in (0.02, 1.0))
    a.force_rng, b.force_rng = RNGTracker(5), RNGTracker(5)
    a.eval(), b.eval()  # (no balancing losses on probs: the gradient is the routing's alone)
    x = torch.randn(4096, hidden, requires_grad=True)
    probs_a, map_a = a(x)
    probs_b, map_b = b(x)
    assert torch.equal(map_a, map_b) and torch.equal(probs_a, probs_b)
    counts = map_a.sum(0).float()
    assert (counts / counts.mean() - 1).abs().max() < 0.1  # 4096 x 2 over 4 experts
    # reference: the same noise as plain logits, gradient through an identity
    ref = TopKRouter(hidden, moe, 1, 2, 0.02)
    ref.load_state_dict(a.state_dict())
    with RNGTracker(5).fork():
        noise = torch.randn(4096, moe.num_experts)
    (probs_a * torch.arange(moe.num_experts)).sum().backward()
    logits = (x.detach() @ ref.weight.t())
    logits.retain_grad()
    routed = logits + (noise - logits).detach()  # value: noise; gradient: identity
    p, _ = ref.routing(routed)
    (p * torch.arange(moe.num_experts)).sum().backward()
    # (the router's gating and this x @ W^T sum float32 products in another order)
    torch.testing.assert_close(a.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)


# --- attention backend --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["unfused", "local", "flash"])
def test_attention_backend_restricts_sdpa_and_keeps_the_math(backend, monkeypatch):
    from torch.nn.attention import SDPBackend

    import megamoe.model.attention_backend as ab

    used: list = []
    real = ab.sdpa_kernel
    monkeypatch.setattr(ab, "sdpa_kernel", lambda k: used.append(list(k)) or real(k))
    x = torch.randint(0, 97, (2, 16))

    def loss(extra: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = GPTModel(run_config_from_args(_args(f"--train-iters 1 {extra}"), 97).model)
        return model(x).float().mean()

    auto = loss("")
    assert used == []
    chosen = loss(f"--attention-backend {backend}")
    want = [SDPBackend.FLASH_ATTENTION] if backend == "flash" else [SDPBackend.MATH]
    assert used and all(k == want for k in used)
    # (different SDPA kernels: equal up to float32 rounding of the softmax sums)
    torch.testing.assert_close(chosen, auto, rtol=1e-5, atol=1e-6)


def test_attention_backend_refusals(capsys):
    err = parse_error(capsys, f"{TINY_MOE} --train-iters 1 --attention-backend flash "
                              "--reset-attention-mask", 1)
    assert "--attention-backend flash cannot run the document mask" in err
    if not torch.cuda.is_available():
        err = parse_error(capsys, f"{TINY_MOE} --train-iters 1 --attention-backend fused", 1)
        assert "--attention-backend fused needs a CUDA device" in err
        _args("--train-iters 1 --attention-backend fused --dry-run")  # the cluster has one


# --- checkpoint format detection and strictness -------------------------------------------------

@pytest.fixture(scope="module")
def saved_dist(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("strict") / "ck")
    pretrain(_args(f"--train-iters 1 --save {out} --save-interval 1"), print_fn=lambda _: None)
    return out


def _iter_dir(root: str) -> str:
    return os.path.join(root, "iter_0000001")


def test_auto_detect_ckpt_format(saved_dist, capsys):
    with pytest.raises(CheckpointError, match="--auto-detect-ckpt-format"):
        pretrain(_args(f"--train-iters 1 --load {saved_dist} --ckpt-format torch"),
                 print_fn=lambda _: None)
    state = pretrain(_args(f"--train-iters 1 --load {saved_dist} --ckpt-format torch "
                           "--auto-detect-ckpt-format"), print_fn=lambda _: None)
    assert state.iteration == 1


def _load(ckpt: str, extra: str, strictness: str):
    model = GPTModel(run_config_from_args(_args(f"--train-iters 1 {extra}"), 97).model)
    common = load_dist_checkpoint(ckpt, model, None, None, None, load_optim=False,
                                  load_rng=False, finetune=True, single=True,
                                  strictness=strictness)
    return model, common


def test_dist_ckpt_strictness(saved_dist, caplog):
    ckpt = _iter_dir(saved_dist)
    plain, _ = _load(ckpt, "", "assume_ok_unexpected")
    for mode in ("assume_ok_unexpected", "raise_unexpected", "raise_all"):
        with pytest.raises(CheckpointError, match="layernorm"):  # q/k norms not saved
            _load(ckpt, "--qk-layernorm", mode)
    with caplog.at_level(logging.WARNING, logger="megamoe.checkpoint"):
        model, common = _load(ckpt, "--qk-layernorm", "log_unexpected")
    unexpected = common["key_mismatch"]["unexpected"]
    assert unexpected and all("layernorm" in k for k in unexpected)
    assert len([r for r in caplog.records if "keeps its initial value" in r.message]) == len(
        unexpected)
    state, ref = model.state_dict(), plain.state_dict()
    for k, v in ref.items():  # every saved tensor loaded; the new norms at their init (1)
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
    for k in set(state) - set(ref):
        assert torch.equal(state[k], torch.ones_like(state[k])), k
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megamoe.checkpoint"):
        _, common = _load(ckpt, "--qk-layernorm", "return_all")
    assert common["key_mismatch"]["unexpected"] == unexpected and not caplog.records


# --- timers -------------------------------------------------------------------------------------

def test_timers_to_tensorboard(tmp_path):
    """--timing-log-level 1: Megatron's "(min, max) time across ranks (ms)" block with the
    forward-backward and optimizer timers; --log-timers-to-tensorboard writes
    {name}-time and iteration-time (seconds per iteration, Megatron's Timers.write)."""
    from tests.training.test_logging import _events

    lines: list[str] = []
    tb = tmp_path / "tb"
    pretrain(_args(f"--train-iters 4 --log-interval 2 --timing-log-level 1 "
                   f"--log-timers-to-tensorboard --tensorboard-dir {tb}"), print_fn=lines.append)
    blocks = [s for s in lines if s.startswith("(min, max) time across ranks (ms):")]
    assert len(blocks) == 2 and "forward-backward" in blocks[0] and "optimizer" in blocks[0]
    acc = _events(str(tb))
    scalars = acc.Tags()["scalars"]
    for name in ("forward-backward-time", "optimizer-time", "iteration-time"):
        assert name in scalars, name
        assert [e.step for e in acc.Scalars(name)] == [2, 4]
    for step in range(2):
        it = acc.Scalars("iteration-time")[step].value
        parts = sum(acc.Scalars(n)[step].value for n in ("forward-backward-time",
                                                         "optimizer-time"))
        assert 0 < parts <= it * 1.05  # (parts of the iteration; 5%: clock reads apart)
    quiet = tmp_path / "quiet"
    lines.clear()
    pretrain(_args(f"--train-iters 2 --log-interval 2 --tensorboard-dir {quiet}"),
             print_fn=lines.append)
    assert "forward-backward-time" not in _events(str(quiet)).Tags()["scalars"]
    assert not [s for s in lines if s.startswith("(min, max)")]


# --- profiling ----------------------------------------------------------------------------------

def test_profile_without_pytorch_profiler_needs_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the nsys range is allowed")
    err = parse_error(capsys, f"{TINY_MOE} --train-iters 1 --profile", 1)
    assert "needs CUDA" in err
    _args("--train-iters 1 --profile --dry-run")


@pytest.mark.slow
def test_pytorch_profiler_range(tmp_path):
    """--profile --use-pytorch-profiler: Megatron's schedule records iterations
    (start, end] (end - start profiler steps) and writes the trace next to the TensorBoard
    directory."""
    import gzip
    import json

    tb = tmp_path / "tb"
    pretrain(_args(f"--train-iters 3 --profile --use-pytorch-profiler --profile-step-start 1 "
                   f"--profile-step-end 2 --tensorboard-dir {tb}"), print_fn=lambda _: None)
    trace = tmp_path / "torch_profile" / "rank-0.json.gz"
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert len(steps) == 1, steps


def _timers_worker(rank: int, world_size: int) -> list[str]:
    import time

    import megamoe.training.loop as loop

    real = loop.forward_backward
    if rank == 0:  # rank 0's forward-backward is 1 s slower: min and max differ
        def slow(*a, **k):
            time.sleep(1.0)
            return real(*a, **k)
        loop.forward_backward = slow
    lines: list[str] = []
    pretrain(_args("--train-iters 2 --log-interval 2 --timing-log-level 1", world_size),
             print_fn=lines.append)
    return [s for s in lines if s.startswith("(min, max)")]


@pytest.mark.slow
def test_timers_min_max_over_ranks():
    """DP=2 over gloo: the logging rank (the last) prints the min and max over both ranks,
    and they come from different ranks (rank 0 sleeps 1 s per forward-backward; the
    bound leaves 0.5 s for the ranks' own compute to differ on a loaded machine: 0.3 s
    with a 0.25 s bound failed at load average 7)."""
    import re

    from tests.distributed import run_distributed

    blocks = run_distributed(_timers_worker, 2, 300)
    assert blocks[0] == [] and len(blocks[1]) == 1
    line = next(s for s in blocks[1][0].splitlines() if "forward-backward" in s)
    lo, hi = map(float, re.findall(r"\(([\d.]+), ([\d.]+)\)", line)[0])
    assert hi - lo > 500 and hi >= 1000, line
