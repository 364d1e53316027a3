"""Training flags that only log or tidy up mean what they mean in Megatron-LM:
--log-params-norm and --log-num-zeros-in-grad (console line and TensorBoard, every parameter
or gradient element counted once in any parallel layout, computed only when asked for) and
--empty-unused-memory-level (torch.cuda.empty_cache() where Megatron's training.py calls
it)."""

from __future__ import annotations

import math
import shlex

import pytest
import torch

import megamoe.training.loop as loop
import megamoe.training.pretrain as pt
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.optim import DistributedOptimizer, MixedPrecisionOptimizer
from tests.distributed import run_distributed
from tests.training.test_logging import _events
from tests.training.test_pretrain import TINY_MOE

LOG = "--log-params-norm --log-num-zeros-in-grad"


def _pretrain(extra: str, world_size: int = 1, lines: list | None = None):
    args = parse_args(shlex.split(f"{TINY_MOE} {extra}"), world_size=world_size)
    return pretrain(args, print_fn=(lines.append if lines is not None else lambda _m: None))


def _capture_model(monkeypatch) -> list:
    built: list = []
    orig = pt.build_model
    monkeypatch.setattr(pt, "build_model",
                        lambda *a, **kw: built.append(orig(*a, **kw)) or built[-1])
    return built


def test_params_norm_and_num_zeros_equal_a_direct_computation(monkeypatch, tmp_path):
    built = _capture_model(monkeypatch)
    lines: list[str] = []
    hist = _pretrain(f"{LOG} --train-iters 2 --log-interval 2 --tensorboard-dir {tmp_path}",
                     lines=lines).history
    params = [p for p in built[0].parameters() if p.requires_grad]
    # after the last step: the weights it wrote, the (clipped) gradients it used
    norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in params))
    zeros = sum(int((p.grad == 0).sum()) for p in params)
    total = sum(p.numel() for p in params)
    assert hist[-1]["params norm"] == pytest.approx(norm, rel=1e-6)
    assert hist[-1]["num zeros"] == zeros
    assert 0 < zeros < total  # e.g. the padded vocabulary rows get no gradient
    assert hist[0]["params norm"] != hist[1]["params norm"]  # measured after each update
    line = [ln for ln in lines if "consumed samples" in ln][-1]
    shown = f" | num zeros: {zeros} | params norm: {hist[-1]['params norm']:.3f} |"
    assert shown in line and line.index("grad norm:") < line.index(shown)
    acc = _events(str(tmp_path))
    assert [e.value for e in acc.Scalars("num_zeros")] == [h["num zeros"] for h in hist]
    assert [e.value for e in acc.Scalars("params_norm")] == pytest.approx(
        [h["params norm"] for h in hist])


def test_not_computed_unless_asked_for(monkeypatch):
    def refuse(*_a, **_kw):
        raise AssertionError("computed without its flag")

    for cls in (MixedPrecisionOptimizer, DistributedOptimizer):
        monkeypatch.setattr(cls, "params_norm", refuse)
        monkeypatch.setattr(cls, "count_zeros", refuse)
    lines: list[str] = []
    hist = _pretrain("--train-iters 1", lines=lines).history
    assert "params norm" not in hist[0] and "num zeros" not in hist[0]
    assert not any("num zeros" in ln or "params norm" in ln for ln in lines)


def _logged(rank: int, world_size: int, extra: str) -> list[tuple[float, float]]:
    hist = _pretrain(f"{LOG} --train-iters 2 {extra}", world_size).history
    return [(h["params norm"], h["num zeros"]) for h in hist]


@pytest.mark.parametrize("layout,model", [
    # (divisor 64 x TP 2 pads the vocabulary to the single process's 128 rows)
    ("--tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 64",
     ""),
    pytest.param("--expert-model-parallel-size 2 --use-distributed-optimizer", "",
                 marks=pytest.mark.slow),  # (the layout sweep: slow set; TP2 stays)
    pytest.param("--pipeline-model-parallel-size 2", "--moe-layer-freq ([0]+[1])",
                 marks=pytest.mark.slow),
], ids=["tp2", "ep2_dp2_distopt", "pp2"])
def test_parallel_layouts_log_the_single_process_values(layout, model):
    """Every parameter and gradient element counted once across tp / ep / pp and the
    distributed optimizer's dp shards: the single-process numbers on every rank."""
    single = _logged(0, 1, model)
    for per_rank in run_distributed(_logged, 2, 240, f"{layout} {model}"):
        assert len(per_rank) == len(single) == 2
        for (norm, zeros), (want_norm, want_zeros) in zip(per_rank, single):
            assert norm == pytest.approx(want_norm, rel=1e-5)
            assert zeros == want_zeros


@pytest.mark.parametrize("level", [0, 1, 2])
def test_empty_unused_memory_level_empties_where_megatron_does(monkeypatch, level):
    """Level >= 1: after the forward-backward of every training step (before the optimizer
    step) and of every evaluation batch; level 2 also after every optimizer step
    (Megatron's train_step and evaluate)."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty"))
    orig_fb = loop.forward_backward

    def fb(*args, forward_only=False, **kwargs):
        events.append("eval" if forward_only else "fb")
        return orig_fb(*args, forward_only=forward_only, **kwargs)

    monkeypatch.setattr(loop, "forward_backward", fb)
    orig_step = MixedPrecisionOptimizer.step

    def step(self, *args, **kwargs):
        events.append("step")
        return orig_step(self, *args, **kwargs)

    monkeypatch.setattr(MixedPrecisionOptimizer, "step", step)
    _pretrain(f"--train-iters 2 --eval-interval 1 --eval-iters 1 "
              f"--empty-unused-memory-level {level}")
    want: list[str] = []
    for name in [e for e in events if e != "empty"]:
        want.append(name)
        if (name in ("fb", "eval") and level >= 1) or (name == "step" and level >= 2):
            want.append("empty")
    assert events == want
    assert events.count("fb") == 2 and events.count("eval") >= 2
