"""The overlap happens (--overlap-grad-reduce, --overlap-param-gather), shown by timestamps
on two gloo ranks of the tiny MoE with two micro-batches per step and several buckets:

- every bucket's collective is launched during the backward of the last micro-batch, right
  after its last parameter's gradient, while gradients of the layers the backward reaches
  later are still being produced; nothing is launched in the first micro-batch;
- no collective is waited on before the backward has produced its last gradient (the waits
  are the step's, never the launching hook's);
- after the update every parameter all-gather is launched before the next forward starts,
  and the gather of the bucket holding the output layer is waited on only after the first
  decoder layer's forward ran.
"""

from __future__ import annotations

import shlex
import time

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.parallel.mesh import init_mesh
from megamoe.training.build import build_model
from megamoe.training.optim import build_optimizer
from megamoe.training.optim.overlap import OverlapOptions
from megamoe.training.schedules import forward_backward
from tests.distributed import run_distributed
from tests.training.test_pretrain import TINY_MOE

VOCAB = 97


class _TimedWork:
    """A collective's work whose wait() is timestamped."""

    def __init__(self, work, log: list, kind: str, bucket: int):
        self.work, self.log, self.kind, self.bucket = work, log, kind, bucket

    def wait(self):
        self.log.append((self.kind, self.bucket, time.perf_counter()))
        if self.work is not None:
            self.work.wait()


def _timed(start, log: list, kind: str, bucket: int):
    def launch():
        return _TimedWork(start(), log, kind, bucket)
    return launch


def _batches(rank: int, n: int):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (2, 17), generator=g)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
               "loss_mask": torch.ones(2, 16)}


def _worker(rank: int, world_size: int, distributed: bool) -> dict:
    flags = f"{TINY_MOE} --train-iters 2" + (" --use-distributed-optimizer" if distributed
                                             else "")
    run = run_config_from_args(parse_args(shlex.split(flags), world_size=world_size), VOCAB)
    mesh = init_mesh(run.parallel)
    model = build_model(run, mesh)
    opt = build_optimizer(model, run.optim, mesh=mesh, distributed=distributed,
                          overlap=OverlapOptions(3000, param_gather=distributed))
    sync = opt.grad_sync
    waits: list = []
    for i, bucket in enumerate(sync.buckets):
        bucket.start = _timed(bucket.start, waits, "wait", i)
    sync.events = []
    name = {id(p): n for n, p in model.named_parameters()}
    grads: list = []  # (time, parameter, last micro-batch?) after the optimizer's hooks
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda p: grads.append((time.perf_counter(), name[id(p)], sync.last_microbatch)))
    opt.zero_grad()
    forward_backward(model, _batches(rank, 2), 2, grad_sync=sync)
    launches = [(b, t) for kind, b, t in sync.events if kind == "launch"]
    opt.step()
    out = {"launches": launches, "waits": waits, "grads": grads,
           "buckets": [[name[id(p)] for p in b.params] for b in sync.buckets]}
    if distributed:
        out.update(_forward_after_step(model, opt))
    return out


def _forward_after_step(model: torch.nn.Module, opt) -> dict:
    """Timestamps of the gathers (launched in the step just taken) and of the next
    forward's decoder layers."""
    gather = opt.param_gather
    # the step launched them already: time the next step's launches and waits instead
    gather.wait()
    log: list = []
    gather.starts = [_timed(s, log, "gather_wait", i) for i, s in enumerate(gather.starts)]
    gather.events = []
    gather.launch()
    layers: list = []
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(
            lambda _m, _a, i=i: layers.append((i, time.perf_counter())))
    with torch.no_grad():
        model(next(_batches(0, 1))["tokens"])
    name = {id(p): n for n, p in model.named_parameters()}
    buckets = [[name[id(p)] for p in b.params] for b in opt.grad_sync.buckets]
    return {"gather_launches": [(b, t) for k, b, t in gather.events if k == "gather_launch"],
            "gather_waits": [(b, t) for _k, b, t in log], "layers": layers,
            "gather_buckets": buckets}


def _check_grad_overlap(r: dict) -> None:
    """(The test's gradient hooks run after the optimizer's: a bucket's launch is stamped
    just before its last parameter's gradient.)"""
    last = [(t, n) for t, n, is_last in r["grads"] if is_last]
    assert len(last) == len(r["grads"]) // 2  # one gradient per parameter per micro-batch
    last_grad = max(t for t, _ in last)
    first_microbatch_done = max(t for t, _, is_last in r["grads"] if not is_last)
    assert len(r["launches"]) == len(r["buckets"]) >= 4
    first_launch = min(t for _, t in r["launches"])
    assert first_launch > first_microbatch_done  # nothing launched in the first one
    # the first bucket goes out while the backward still produces most gradients
    later = [n for t, n in last if t > first_launch]
    assert first_launch < last_grad and len(later) >= len(last) // 2, later
    for b, t in r["launches"]:  # launched by the hook of the bucket's last parameter
        own = sorted(tg for tg, n in last if n in r["buckets"][b])
        assert all(tg < t for tg in own[:-1]) and t < own[-1], (b, r["buckets"][b])
        assert not [tg for tg, _ in last if t < tg < own[-1]], (b, r["buckets"][b])
    # no wait before the backward is over: not in the launching hooks
    assert r["waits"] and all(t > last_grad for _kind, _b, t in r["waits"]), r["waits"]


def _check_gather_overlap(r: dict) -> None:
    first_layer = min(t for i, t in r["layers"] if i == 0)
    assert all(t < first_layer for _, t in r["gather_launches"])
    assert len(r["gather_launches"]) == len(r["gather_buckets"])
    waits = dict(r["gather_waits"])
    assert len(waits) == len(r["gather_buckets"])  # each waited for once
    # the untied output layer is only a weight holder (lm_head reads its weight, its
    # forward never runs): its bucket is waited for before the first layer runs
    output = next(b for b, names in enumerate(r["gather_buckets"])
                  if any(n.startswith("output_layer") for n in names))
    assert waits[output] < first_layer
    # the last layer's own buckets arrive while the first layer computes
    late = [b for b, names in enumerate(r["gather_buckets"])
            if all(n.startswith("decoder.layers.1.") for n in names)]
    assert late and all(waits[b] > first_layer for b in late), (r["gather_waits"],
                                                               first_layer)


@pytest.mark.parametrize("distributed", [
    pytest.param(False, marks=pytest.mark.slow, id="allreduce"),  # (the default set: one)
    pytest.param(True, id="distopt")])
def test_buckets_reduce_during_backward_and_gather_during_forward(distributed):
    for r in run_distributed(_worker, 2, 120, distributed):
        _check_grad_overlap(r)
        if distributed:
            _check_gather_overlap(r)
