"""The MoE layer's path on the accelerator, checked on a CPU machine: router, permutation,
dispatch (one rank; EP=2 with the all-to-all and all-gather dispatchers and the a2a
overlap; TP=2 + SP with experts split over ETP=2), grouped
experts, combine and the balancing losses, forward and backward, in a GPT model built and
materialised on the stand-in accelerator (tests/test_fake_device.py: "meta" under
FakeTensorMode, where any CPU/device mix fails).

Fake tensors have no values, so the dispatch's data-dependent sizes (the permutation's
`nonzero`, the split sizes' and host group sizes' `tolist`) come from a real CPU run of the
same model, routing and layout (tests/host_reads.py records and replays them in order).
Expert-parallel ranks run one at a time in a fresh process on torch's fake process group
(collectives on fake tensors move nothing), each replaying its own rank's reads from a
real 2-rank gloo run; tests/collective_check.py asserts every collective's tensors are on
the mesh device and contiguous, and the ranks' records show the same collectives and
dtypes in the same order.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megamoe.config import MoEConfig, MoEExecutionConfig, ParallelConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.parallel.mesh import Mesh, build_mesh, single_process_mesh
from megamoe.parallelize import parallelize
from megamoe.training.materialize import materialize
from tests.collective_check import CollectiveCheck, same_on_every_rank
from tests.device_mix import DeviceMix
from tests.distributed import run_distributed
from tests.host_reads import HostReads
from tests.test_fake_device import ACCEL, DENSE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE = dataclasses.replace(DENSE, moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=48,
                                               aux_loss_coeffs=[1e-2], z_loss_coeff=1e-3))
# Capacity with padding, the sequence and global balancing losses (the global one's running
# counts live in router buffers) and the expert bias (its counts and update), at once.
FEATURES = dataclasses.replace(DENSE, moe=MoEConfig(
    num_experts=4, topk=2, ffn_hidden_size=48, score_function="sigmoid",
    load_balancing_types=["seq_aux_loss", "global_aux_loss"], aux_loss_coeffs=[1e-2, 1e-2],
    capacity_factor=1.0, pad_to_capacity=True, enable_expert_bias=True))


def _model(mesh: Mesh, parallel: ParallelConfig, execution: MoEExecutionConfig,
           dtype: torch.dtype, config=MOE) -> torch.nn.Module:
    with torch.device("meta"):
        model = GPTModel(config)
    return parallelize(model, mesh, parallel, execution, seed=1, dtype=dtype)


def _tokens(rank: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(rank)
    return torch.randint(0, MOE.vocab_size, (2, MOE.seq_length), generator=g).to(device)


def _step(model: torch.nn.Module, tokens: torch.Tensor, reads: HostReads) -> None:
    with reads.active(), DeviceMix():  # (DeviceMix: in-place mixes the fake mode allows)
        model(tokens, labels=tokens).float().mean().backward()


def _check_on_device(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        assert p.device == ACCEL and p.grad is not None and p.grad.device == ACCEL, name


@pytest.mark.parametrize("grouped, dtype, config", [
    (True, torch.bfloat16, MOE), (False, torch.bfloat16, MOE), (False, torch.float32, MOE),
    (True, torch.bfloat16, FEATURES)],
    ids=["torch-grouped-bf16", "loop-bf16", "loop-fp32", "capacity-pad-seq-global-aux-bias"])
def test_single_rank_moe_forward_backward_on_the_device(grouped, dtype, config):
    execution = MoEExecutionConfig(grouped_gemm=grouped)
    cpu = single_process_mesh(torch.device("cpu"))
    real = materialize(_model(cpu, ParallelConfig(), execution, dtype, config), cpu, seed=1)
    recorded = HostReads()
    _step(real, _tokens(0, cpu.device), recorded)
    # one per MoE layer; padded to capacity the shapes are static: none
    assert [k for k, _ in recorded.log].count("nonzero") == (0 if config is FEATURES else 2)
    mesh = single_process_mesh(ACCEL)
    model = _model(mesh, ParallelConfig(), execution, dtype, config)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = materialize(model, mesh, seed=1)
        replay = HostReads(recorded.log)
        _step(model, _tokens(0, ACCEL), replay)
        assert replay.log == []  # every recorded read made, none more
        _check_on_device(model)
        if config is FEATURES:  # the router's running counts, on the device and advanced
            for router in [m for m in model.modules() if hasattr(m, "expert_bias")]:
                for buf in (router.expert_bias, router.local_tokens_per_expert,
                            router.global_tokens_per_expert, router.global_num_tokens):
                    assert buf.device == ACCEL


EP2 = ParallelConfig(world_size=2, expert_model_parallel_size=2)
# TP=2 with sequence parallelism, experts split over ETP=2 (EP=1): TP's and ETP's
# all-gathers and reduce-scatters around the experts.
TP2_ETP2 = ParallelConfig(world_size=2, tensor_model_parallel_size=2, sequence_parallel=True,
                          expert_tensor_parallel_size=2)
VARIANTS = {  # name: (dispatcher, a2a overlap degree, layout)
    "alltoall": ("alltoall", 1, EP2), "allgather": ("allgather", 1, EP2),
    "alltoall-overlap2": ("alltoall", 2, EP2), "tp2-sp-etp2": ("alltoall", 1, TP2_ETP2),
    "shared-overlap": ("alltoall", 1, EP2)}
# --moe-shared-expert-overlap: a gated shared expert inside the all-to-all's exchanges.
SHARED = dataclasses.replace(MOE, moe=dataclasses.replace(
    MOE.moe, shared_expert_intermediate_size=32, shared_expert_gate=True))


def _execution(variant: str) -> MoEExecutionConfig:
    dispatcher, overlap, _ = VARIANTS[variant]
    return MoEExecutionConfig(grouped_gemm=True, token_dispatcher_type=dispatcher,
                              a2a_overlap_degree=overlap,
                              shared_expert_overlap=variant == "shared-overlap")


def _config(variant: str):
    return SHARED if variant == "shared-overlap" else MOE


def _record_rank(rank: int, world_size: int, dispatcher: str) -> list:
    layout = VARIANTS[dispatcher][2]
    mesh = build_mesh(layout, "gloo", torch.device("cpu"))
    execution = _execution(dispatcher)
    model = materialize(_model(mesh, layout, execution, torch.bfloat16, _config(dispatcher)),
                        mesh, seed=1)
    reads = HostReads()
    _step(model, _tokens(rank, mesh.device), reads)
    return reads.log


def replay_rank(rank: int, dispatcher: str, log_path: str) -> None:
    """Rank `rank` of EP=2 on the fake process group and the fake device (a fresh
    process: the fake group must be its only process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    with open(log_path, "rb") as f:
        log = pickle.load(f)
    layout = VARIANTS[dispatcher][2]
    mesh = build_mesh(layout, "fake", ACCEL)
    execution = _execution(dispatcher)
    model = _model(mesh, layout, execution, torch.bfloat16, _config(dispatcher))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = materialize(model, mesh, seed=1)
        replay = HostReads(log)
        with CollectiveCheck(mesh.device) as check:
            _step(model, _tokens(rank, ACCEL), replay)
        assert replay.log == [], replay.log
        _check_on_device(model)
    with open(log_path + ".collectives", "wb") as f:
        pickle.dump(check.log, f)


@pytest.mark.parametrize("dispatcher", [
    "alltoall", pytest.param("allgather", marks=pytest.mark.slow),
    pytest.param("alltoall-overlap2", marks=pytest.mark.slow),
    pytest.param("tp2-sp-etp2", marks=pytest.mark.slow),
    pytest.param("shared-overlap", marks=pytest.mark.slow)])
def test_expert_parallel_dispatch_on_the_device(tmp_path, dispatcher):
    logs = run_distributed(_record_rank, 2, 120, dispatcher)
    if VARIANTS[dispatcher][2] is EP2 and VARIANTS[dispatcher][0] == "alltoall":
        # the split sizes: one host copy per MoE layer call
        assert all([k for k, _ in log].count("tolist") == 2 for log in logs)
    for rank, log in enumerate(logs):
        path = tmp_path / f"reads{rank}.pkl"
        path.write_bytes(pickle.dumps(log))
        code = ("from tests.moe.test_fake_device_moe import replay_rank; "
                f"replay_rank({rank}, {dispatcher!r}, {str(path)!r})")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
    issued = [pickle.loads((tmp_path / f"reads{r}.pkl.collectives").read_bytes())
              for r in range(len(logs))]
    want = ("c10d::alltoall_base_" if VARIANTS[dispatcher][:3:2] == ("alltoall", EP2)
            else "c10d::_allgather_base_")
    assert any(name == want for name, _ in issued[0]), issued[0]
    same_on_every_rank(issued)
