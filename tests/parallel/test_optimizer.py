"""The optimizer wrapper against plain torch.optim, fp32 accumulation with bf16, clip, skip."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megamoe.config import OptimizerConfig
from megamoe.training.optim import build_optimizer, common
from megamoe.training.optim.distributed import DistributedOptimizer
from tests.tolerances import ulp_tol


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4)).to(dtype)


def _loss(model, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


def test_fp32_step_equals_adamw_with_megatron_weight_decay_groups():
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    model, ref = _model(), _model()
    opt = build_optimizer(model, cfg)
    decay = [p for n, p in ref.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in ref.named_parameters() if p.ndim == 1]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        ok, norm, _ = opt.step()
        ref_opt.zero_grad()
        _loss(ref, step).backward()
        ref_norm = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in ref.parameters()]))
        ref_opt.step()
        assert ok and math.isclose(norm, float(ref_norm), rel_tol=1e-6)
    # megamoe runs torch's fused AdamW kernel, the reference its foreach one: the same
    # formula in another order of operations (measured on one CPU: 11 of 128 elements 1.5e-8
    # apart). Each step rounds ~8 times at the parameters' scale, 3 steps: 32 units of fp32
    # roundoff. Decaying the biases too, the mistake this test is for, moves them by
    # lr x weight decay = 1e-3 of their size per step, ~100x more.
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **ulp_tol(q, 32))


def test_clipping_scales_to_clip_grad():
    cfg = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0,
                          clip_grad=1e-3)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(model, cfg)
    opt.zero_grad()
    _loss(model, 0).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    ok, norm, _ = opt.step()
    assert ok and norm > 1e-3
    update_norm = torch.linalg.vector_norm(torch.stack(
        [(b - p.detach()).norm() for b, p in zip(before, model.parameters())]))
    assert math.isclose(float(update_norm), 1e-3, rel_tol=1e-4)
    for b, p, g in zip(before, model.parameters(), grads):
        torch.testing.assert_close(b - p.detach(), g * (1e-3 / (norm + 1e-6)))


def test_non_finite_gradient_skips_the_update():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    opt.zero_grad()
    (_loss(model, 0) * float("nan")).backward()
    ok, norm, _ = opt.step()
    assert not ok and not math.isfinite(norm)
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p)


def test_bf16_accumulates_gradients_in_fp32_and_keeps_fp32_main_params():
    model = _model(torch.bfloat16)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, clip_grad=0.0))
    opt.zero_grad()
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    for seed in range(4):
        _loss(model, seed).backward()
        # the hook moved this micro-batch's bf16 gradient into the fp32 main gradient
        assert all(p.grad is None for p in model.parameters())
    for seed in range(4):  # reference: per-micro-batch bf16 grads summed in fp32
        ref = _model(torch.bfloat16)
        _loss(ref, seed).backward()
        for e, p in zip(expected, ref.parameters()):
            e += p.grad.float()
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for p, main in zip(opt.model_params, opt.main_params):
        assert main.dtype == torch.float32
        torch.testing.assert_close(main.grad, expected[index[id(p)]], rtol=0, atol=0)
    ok, _, _ = opt.step()
    assert ok
    for p, main in zip(opt.model_params, opt.main_params):
        assert torch.equal(p, main.to(torch.bfloat16))


def test_reduce_fn_sees_every_gradient_once():
    model = _model()
    seen = []
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3), reduce_grads_fn=seen.append)
    opt.zero_grad()
    _loss(model, 0).backward()
    opt.step()
    assert len(seen) == 1 and len(seen[0]) == len(list(model.parameters()))


class _ApexLikeFusedAdam(torch.optim.AdamW):
    """Stand-in with apex FusedAdam's conventions (constructor, step count per group, no
    per-parameter "step"): what our state handling must cope with."""

    def __init__(self, params, adam_w_mode=True, **kw):
        assert adam_w_mode
        super().__init__(params, **kw)

    def step(self, closure=None):
        for group in self.param_groups:  # torch's AdamW does the math, its count hidden
            for p in group["params"]:
                if "step_" in self.state[p]:
                    self.state[p]["step"] = self.state[p].pop("step_")
        super().step(closure)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                self.state[p]["step_"] = self.state[p].pop("step")


def _distributed(model, config):
    return DistributedOptimizer(model, config, tp_group=None, dp_group=None)


@pytest.mark.parametrize("build", [build_optimizer, _distributed], ids=["plain", "distributed"])
def test_apex_fused_adam_contract(monkeypatch, build):
    """On GPU main parameters with apex importable the inner optimizer is apex's FusedAdam
    in AdamW mode, and the layout-free checkpoint state keeps its step count (per group),
    in the plain and the distributed optimizer."""
    monkeypatch.setattr(common, "_ApexFusedAdam", _ApexLikeFusedAdam)
    monkeypatch.setattr(common, "_on_gpu", lambda groups: True)
    model = torch.nn.Linear(4, 3)
    opt = build(model, OptimizerConfig(lr=1e-2))
    assert isinstance(opt.optimizer, _ApexLikeFusedAdam)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    states, step, _ = opt.param_states()
    assert float(step) == 2 and all("exp_avg" in s for s in states)
    again = build(torch.nn.Linear(4, 3), OptimizerConfig(lr=1e-2))
    again.load_param_states(states, step)
    assert all(g["step"] == 2 for g in again.optimizer.param_groups)


def test_saved_step_count_is_a_host_scalar_restored_where_the_optimizer_keeps_it():
    """A fused or capturable torch Adam keeps its step on the parameter's device: the
    checkpoint's copy is a host fp32 scalar (the common file loads anywhere), and loading
    puts it back on the device ("meta" stands in for the GPU)."""
    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    state = {"step": torch.tensor(5.0, dtype=torch.float64)}
    saved = common.step_count(torch.optim.SGD([torch.zeros(1)], lr=1.0), state)
    assert saved.device.type == "cpu" and saved.dtype == torch.float32 and float(saved) == 5
    host = torch.tensor(5.0)
    for flags, device in (({"fused": True}, "meta"), ({"capturable": True}, "meta"),
                          ({"fused": None}, "cpu")):
        fake = SimpleNamespace(param_groups=[{"params": [p], **flags}])
        restored = common.restored_step(fake, host, p)
        assert restored.device.type == device and restored.dtype == torch.float32
