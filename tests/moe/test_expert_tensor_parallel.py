"""An MoE layer inside TP + SP, with experts split over F (ETP = TP) or tokens split over
the TP ranks (ETP = 1), alone and with expert parallelism, equals the single-process layer:
outputs, input and router gradients on every rank, expert gradients after the edp sum
(biases, shared experts with gate, aux and z losses included; the shared experts split
over TP, as Megatron's)."""

from __future__ import annotations

import copy

import pytest
import torch

from megamoe.config import ConfigError, MoEConfig, MoEExecutionConfig, ParallelConfig
from megamoe.moe.dispatchers import TensorParallelDispatcher
from megamoe.moe.layer import MoELayer
from megamoe.moe.losses import MoELossTracker, set_aux_loss_backward_scale
from megamoe.parallel.mesh import build_mesh
from megamoe.parallelize import parallelize_moe
from tests.distributed import run_distributed

E, H, FF, S, B = 4, 8, 6, 8, 2


def _full_layer(dispatcher: str) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, topk=2, ffn_hidden_size=FF,
                    load_balancing_types=["aux_loss"], aux_loss_coeffs=[0.1], z_loss_coeff=0.01,
                    shared_expert_intermediate_size=4, shared_expert_gate=True)
    layer = MoELayer(cfg, H, init_method_std=0.3, add_bias_linear=True, grouped_gemm=True)
    with torch.no_grad():  # non-zero biases so a bias counted twice would show
        layer.experts.fc1_bias.normal_(0.0, 0.5)
        layer.experts.fc2_bias.normal_(0.0, 0.5)
    return layer


def _data(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + replica)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _run_layer(layer: MoELayer, x_SBH: torch.Tensor, grad_SBH: torch.Tensor) -> torch.Tensor:
    x = x_SBH.clone().requires_grad_(True)
    out = layer(x)
    (out * grad_SBH).sum().backward()
    return out.detach(), x.grad


def _worker(rank: int, world: int, tp: int, ep: int, etp: int, dispatcher: str) -> bool:
    MoELossTracker.clear()
    set_aux_loss_backward_scale(1.0)
    mesh = build_mesh(ParallelConfig.layout(world, tp=tp, ep=ep, etp=etp), "gloo")
    full = _full_layer(dispatcher)
    layer = parallelize_moe(copy.deepcopy(full), ep_group=mesh.group("ep"),
                            tp_group=mesh.group("tp"), etp_group=mesh.group("etp"),
                            execution=MoEExecutionConfig(token_dispatcher_type=dispatcher))
    assert isinstance(layer.dispatcher, TensorParallelDispatcher)
    local_experts = E // ep
    assert layer.experts.fc1_weight.shape == (local_experts, H, 2 * FF // etp)
    # Single-process references, one per data-parallel replica (gradients kept apart).
    refs = []
    for d in range(mesh.dp_size):
        ref = copy.deepcopy(full)
        refs.append((ref, *_run_layer(ref, *_data(d))))
    MoELossTracker.clear()
    x, grad = _data(mesh.local_rank_in("dp"))
    t, shard = mesh.local_rank_in("tp"), S // tp
    own = slice(t * shard, (t + 1) * shard)
    x_local = x[own].clone().requires_grad_(True)
    out = layer(x_local)  # this rank's sequence shard in, its shard out
    (out * grad[own]).sum().backward()
    ref, ref_out, ref_xgrad = refs[mesh.local_rank_in("dp")]
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref_out[own], **tol)
    torch.testing.assert_close(x_local.grad, ref_xgrad[own], **tol)
    torch.testing.assert_close(layer.router.weight.grad, ref.router.weight.grad, **tol)
    _check_shared_experts(layer, ref, mesh, tol)
    # Experts: sum over the edp replicas (and, for the replicated fc2 bias, over etp, as
    # reduce_gradients does for `sequence_parallel` parameters) == sum over replicas.
    e0, j = layer.experts.expert_offset, mesh.local_rank_in("etp")
    for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        p = getattr(layer.experts, name)
        g = p.grad.clone()
        if getattr(p, "sequence_parallel", False) and mesh.group("tp") is not None:
            torch.distributed.all_reduce(g, group=mesh.group("tp"))
        if mesh.group("edp") is not None:
            torch.distributed.all_reduce(g, group=mesh.group("edp"))
        want = sum(getattr(r.experts, name).grad for r, _, _ in refs)[e0:e0 + local_experts]
        if getattr(p, "etp_sharded", False):
            if name.startswith("fc1"):  # [gate slice j | up slice j]
                want = torch.cat([b.chunk(etp, dim=-1)[j] for b in want.chunk(2, dim=-1)], -1)
            else:
                want = want.chunk(etp, dim=1)[j]
        torch.testing.assert_close(g, want, **tol)
    return True


def _check_shared_experts(layer: MoELayer, ref: MoELayer, mesh, tol: dict) -> None:
    """The shared experts are split over TP like a dense MLP (fc1 [gate slice t; up slice
    t] rows, fc2 columns t); the gate and fc2 bias are whole, their gradients partial per
    sequence shard and marked for the TP sum. After that sum every gradient is this rank's
    slice of the single-process one."""
    tp, t = mesh.tp_size, mesh.local_rank_in("tp")
    mine, full = dict(layer.shared_experts.named_parameters()), \
        dict(ref.shared_experts.named_parameters())
    assert set(mine) == {"linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight",
                         "linear_fc2.bias", "gate_weight"}
    for name, p in mine.items():
        want = full[name].grad
        if name.startswith("linear_fc1"):
            want = torch.cat([b.chunk(tp)[t] for b in want.chunk(2)])
        elif name == "linear_fc2.weight":
            want = want.chunk(tp, dim=1)[t]
        assert getattr(p, "tensor_model_parallel", False) == (p.shape != full[name].shape)
        assert getattr(p, "sequence_parallel", False) == (p.shape == full[name].shape)
        assert p.numel() == full[name].numel() // (tp if p.shape != full[name].shape else 1)
        g = p.grad.clone()
        if getattr(p, "sequence_parallel", False):
            torch.distributed.all_reduce(g, group=mesh.group("tp"))
        torch.testing.assert_close(g, want, **tol)


@pytest.mark.parametrize("etp", [1, 2])
def test_tp2_layer_matches_single_process(etp):
    assert all(run_distributed(_worker, 2, 120, 2, 1, etp, "alltoall"))


@pytest.mark.parametrize("etp, dispatcher", [
    (1, "alltoall"), pytest.param(2, "allgather", marks=pytest.mark.slow)])
def test_tp2_x_ep2_layer_matches_single_process(etp, dispatcher):
    assert all(run_distributed(_worker, 4, 180, 2, 2, etp, dispatcher))


def test_etp_other_than_one_or_tp_is_refused():
    with pytest.raises(ConfigError, match="not supported yet: --expert-tensor-parallel-size 2"):
        ParallelConfig.layout(8, tp=4, etp=2)


def _shared_share_worker(rank: int, world: int) -> tuple[int, int, float, float]:
    """(shared-expert parameters on this rank, in one process; their forward + backward
    FLOPs on this rank's sequence shard, on the whole sequence in one process)."""
    from torch.utils.flop_counter import FlopCounterMode

    mesh = build_mesh(ParallelConfig.layout(world, tp=world), "gloo")
    full = _full_layer("alltoall")
    layer = parallelize_moe(copy.deepcopy(full), tp_group=mesh.group("tp"),
                            etp_group=mesh.group("etp"))
    x, grad = _data(0)
    own = slice(rank * S // world, (rank + 1) * S // world)

    def flops(shared, x_SBH, grad_SBH) -> float:
        x_SBH = x_SBH.clone().requires_grad_(True)
        with FlopCounterMode(display=False) as counter:
            (shared(x_SBH) * grad_SBH).sum().backward()
        return counter.get_total_flops()

    def count(m) -> int:
        return sum(p.numel() for p in m.parameters())

    return (count(layer.shared_experts), count(full.shared_experts),
            flops(layer.shared_experts, x[own], grad[own]),
            flops(full.shared_experts, x, grad))


@pytest.mark.slow  # (default-set budget: a representative case stays)
def test_each_tp_rank_holds_and_runs_its_share_of_the_shared_experts():
    """TP=2: each rank holds half of the shared experts' matrices (the [1, H] gate and the
    fc2 bias [H] stay whole) and runs half of their FLOPs, forward and backward (before,
    every rank held them whole and ran them on the whole gathered sequence: TP times)."""
    for mine, whole, mine_flops, whole_flops in run_distributed(_shared_share_worker, 2, 120):
        assert mine == (whole - 2 * H) // 2 + 2 * H
        assert mine_flops == whole_flops / 2 and whole_flops > 0
