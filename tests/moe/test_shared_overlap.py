"""--moe-shared-expert-overlap (moe/shared_overlap.py): the shared expert's fc1 runs while
the dispatch all-to-all is in flight and its fc2 while the combine all-to-all is; the
layer's output and every gradient equal the layer without the overlap (fp32, same
operations in another order), at EP=1 and on two gloo ranks at EP=2; the flag is refused in
one line where Megatron-LM refuses it.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import megamoe.moe.dispatchers.alltoall as alltoall_module
import megamoe.moe.shared_overlap as so
from megamoe.config import MoEConfig, MoEExecutionConfig
from megamoe.moe.experts import SharedExpertMLP
from megamoe.moe.layer import MoELayer
from megamoe.moe.losses import MoELossTracker, set_aux_loss_backward_scale
from megamoe.moe.shared_overlap import SharedExpertOverlap
from megamoe.parallelize import parallelize_moe
from tests.distributed import run_distributed
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

E, H, FF, SHARED, T = 4, 8, 6, 10, 12
# Equal up to the order of floating-point sums (the input's gradient adds the shared and
# routed branches' contributions in another order): a few fp32 ulps.
TOL = dict(rtol=1e-6, atol=1e-7)


def _layer(gate: bool) -> MoELayer:
    MoELossTracker.clear()
    set_aux_loss_backward_scale(1.0)
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, topk=2, ffn_hidden_size=FF, aux_loss_coeffs=[1e-2],
                    shared_expert_intermediate_size=SHARED, shared_expert_gate=gate)
    return MoELayer(cfg, H, init_method_std=0.3, grouped_gemm=True)


def _run(layer: MoELayer, x_TH: torch.Tensor, grad_TH: torch.Tensor):
    """Output, input gradient and every parameter's gradient of one forward/backward."""
    x = x_TH.clone().requires_grad_(True)
    out = layer(x)
    (out * grad_TH).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _record_order(monkeypatch) -> list[str]:
    """Log the asynchronous all-to-alls' starts and waits and the shared halves."""
    log: list[str] = []

    def logged(name, fn):
        def wrapper(*args, **kwargs):
            log.append(name)
            return fn(*args, **kwargs)
        return wrapper

    for name in ("all_to_all_start", "all_to_all_wait"):
        monkeypatch.setattr(alltoall_module, name,
                            logged(name[11:], getattr(alltoall_module, name)))
    for half in ("fc1", "fc2"):
        monkeypatch.setattr(SharedExpertOverlap, half,
                            logged(half, getattr(SharedExpertOverlap, half)))
    return log


def _compare(ep_group, rank: int, gate: bool, degree: int = 1,
             log: list[str] | None = None) -> list[str]:
    """This rank's layer with and without the overlap: same outputs and gradients."""
    full = _layer(gate)
    plain, overlapped = (parallelize_moe(copy.deepcopy(full), ep_group=ep_group,
                                         execution=MoEExecutionConfig(
                                             token_dispatcher_type="alltoall",
                                             a2a_overlap_degree=degree,
                                             shared_expert_overlap=on))
                         for on in (False, True))
    assert overlapped.shared_expert_overlap and not plain.shared_expert_overlap
    g = torch.Generator().manual_seed(rank)
    x_TH, grad_TH = torch.randn(2, T, H, generator=g)
    ref = _run(plain, x_TH, grad_TH)
    # The overlapped layer never calls the shared expert whole.
    mlp = overlapped.shared_experts
    mlp.forward = lambda *a: (_ for _ in ()).throw(AssertionError("ran unsplit"))
    if log is not None:
        log.clear()  # the overlapped layer's exchanges only
    got = _run(overlapped, x_TH, grad_TH)
    torch.testing.assert_close(got[0], ref[0], **TOL)
    torch.testing.assert_close(got[1], ref[1], **TOL)
    assert got[2].keys() == ref[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], **TOL, msg=name)
    return sorted(ref[2])


@pytest.mark.parametrize("gate", [False, True])
def test_overlap_equals_plain_layer_at_ep1(gate):
    """EP=1 (the local dispatcher: the halves run after dispatch and combine)."""
    names = _compare(None, 0, gate)
    assert "shared_experts.linear_fc1.weight" in names
    assert ("shared_experts.gate_weight" in names) == gate


def _ep2_worker(rank: int, world: int, degree: int) -> list[str]:
    import pytest as _pytest  # noqa: PLC0415

    with _pytest.MonkeyPatch.context() as mp:
        log = _record_order(mp)
        _compare(dist.group.WORLD, rank, gate=True, degree=degree, log=log)
    return log


def test_overlap_equals_plain_layer_at_ep2():
    """Two gloo ranks, EP=2: fc1 runs between the dispatch exchange's start and wait,
    fc2 between the combine exchange's; outputs and gradients equal the plain layer."""
    logs = run_distributed(_ep2_worker, 2, 120, 1)
    assert logs == [["start", "fc1", "wait", "start", "fc2", "wait"]] * 2


@pytest.mark.slow
def test_overlap_with_a2a_overlap_degree_2():
    """With --moe-a2a-overlap-degree 2: fc1 during the first chunk's dispatch, fc2 during
    the last chunk's combine."""
    logs = run_distributed(_ep2_worker, 2, 120, 2)
    assert logs == [["start", "fc1", "start", "wait", "start", "wait", "start", "fc2",
                     "wait", "wait"]] * 2


def _tp2_worker(rank: int, world: int, etp: bool) -> bool:
    """TP=2 + SP (the layer takes this rank's sequence shard; the shared expert's fc1
    all-gathers the sequence and its fc2 reduce-scatters it inside the halves)."""
    full = _layer(gate=True)
    group = dist.group.WORLD
    plain, overlapped = (parallelize_moe(copy.deepcopy(full), tp_group=group,
                                         etp_group=group if etp else None,
                                         execution=MoEExecutionConfig(
                                             token_dispatcher_type="alltoall",
                                             shared_expert_overlap=on))
                         for on in (False, True))
    g = torch.Generator().manual_seed(0)  # every TP rank holds the same sequence
    x_SBH, grad_SBH = torch.randn(2, T, 2, H, generator=g)
    rows = slice(rank * T // world, (rank + 1) * T // world)
    ref = _run(plain, x_SBH[rows], grad_SBH[rows])
    got = _run(overlapped, x_SBH[rows], grad_SBH[rows])
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, **TOL)
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], **TOL, msg=name)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("etp", [True, False], ids=["etp2", "etp1"])
def test_overlap_equals_plain_layer_under_tp2_sp(etp):
    assert run_distributed(_tp2_worker, 2, 120, etp) == [True, True]


SHARED_FLAGS = "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-overlap"


@pytest.mark.parametrize("extra, message", [
    ("--moe-shared-expert-overlap --moe-token-dispatcher-type alltoall",
     "--moe-shared-expert-overlap needs shared experts (--moe-shared-expert-intermediate-"
     "size)"),
    (SHARED_FLAGS, "--moe-shared-expert-overlap only works with --moe-token-dispatcher-type "
                   "alltoall or flex"),
    (f"{SHARED_FLAGS} --moe-token-dispatcher-type alltoall --recompute-granularity "
     "selective --recompute-modules shared_experts",
     "--recompute-modules shared_experts cannot work with --moe-shared-expert-overlap"),
])
def test_refused_where_megatron_refuses(capsys, extra, message):
    assert message in parse_error(capsys, f"{TINY_MOE} --train-iters 1 {extra}", 1)


def test_unsplit_forward_is_the_two_halves():
    """SharedExpertMLP.forward is fc2_forward(fc1_forward(x)) (gate included)."""
    torch.manual_seed(0)
    mlp = SharedExpertMLP(H, SHARED, swiglu=True, add_bias=False, gate=True,
                          init_method_std=0.3, output_init_std=0.3)
    x = torch.randn(T, H)
    h, score = mlp.fc1_forward(x)
    ref = mlp.linear_fc2(h) * torch.sigmoid(x @ mlp.gate_weight.t())
    torch.testing.assert_close(mlp(x), ref)


class _FakeStream:
    """Stands in for a CUDA stream: logs waits and whether work runs inside it."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.active = name, log, False

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(f"{self.name} waits {other.name}")


def test_cuda_stream_protocol(monkeypatch):
    """The CUDA-only branch (no GPU here): the side stream waits for the default one before
    fc1, both halves run inside the side stream, the input is recorded on the side stream
    and the output on the default one, and the default stream waits before the sum."""
    log: list[str] = []
    side, default = _FakeStream("side", log), _FakeStream("default", log)

    @contextlib.contextmanager
    def on(stream):
        stream.active = True
        yield
        stream.active = False

    monkeypatch.setattr(so, "side_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, s: log.append(f"{tuple(t.shape)} on {s.name}"))
    torch.manual_seed(0)
    mlp = SharedExpertMLP(H, SHARED, swiglu=True, add_bias=False, gate=True,
                          init_method_std=0.3, output_init_std=0.3)
    for half in ("fc1_forward", "fc2_forward"):
        fn = getattr(mlp, half)
        monkeypatch.setattr(mlp, half, lambda *a, fn=fn, half=half: (
            log.append(f"{half} on {'side' if side.active else 'default'}"), fn(*a))[1])
    x = torch.randn(T, H)
    shared = SharedExpertOverlap(mlp, x)
    shared.fc1()
    shared.fc2()
    out = shared.output()
    assert log == ["side waits default", f"{(T, H)} on side", "fc1_forward on side",
                   "fc2_forward on side", "default waits side", f"{(T, H)} on default"]
    torch.testing.assert_close(out, SharedExpertMLP.forward(mlp, x))
