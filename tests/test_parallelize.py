"""The parallelize step on one process standing in for one rank of a larger layout (torch's
fake process-group backend: groups and DeviceMeshes exist, collectives do nothing):
every MoE layer gets the dispatcher of its layout, and a model built on the meta device
parallelizes to exactly the shards (names, shapes, dtypes, parallel attributes) of the
same model built on the CPU, without allocating them."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megamoe.config import ModelConfig, MoEConfig, MoEExecutionConfig, ParallelConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.moe.dispatchers import (
    AdaptiveDispatcher,
    AllGatherDispatcher,
    AllToAllDispatcher,
    LocalDispatcher,
    TensorParallelDispatcher,
)
from megamoe.moe.layer import MoELayer
from megamoe.parallel.mesh import build_mesh, single_process_mesh
from megamoe.parallelize import parallelize

CONFIG = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                     num_query_groups=2, seq_length=16, max_position_embeddings=16,
                     vocab_size=97, swiglu=True, add_bias_linear=False,
                     moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=48),
                     moe_layer_pattern=[0, 1, 1, 1])
ATTRIBUTES = ("tensor_model_parallel", "sequence_parallel", "expert_parallel", "etp_sharded",
              "shared_embedding", "shared_copy")


@contextlib.contextmanager
def fake_rank(rank: int, parallel: ParallelConfig):
    """The mesh of `rank` in `parallel`'s layout, this process standing in for it."""
    if parallel.world_size == 1:
        yield single_process_mesh()
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank,
                            world_size=parallel.world_size)
    try:
        yield build_mesh(parallel, "gloo")
    finally:
        dist.destroy_process_group()


def _layout(tp=1, pp=1, ep=1, etp=None, world=1, **kw) -> ParallelConfig:
    return ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                          sequence_parallel=tp > 1, world_size=world, **kw)


def _describe(model: torch.nn.Module) -> list[tuple]:
    return [(n, tuple(p.shape), p.dtype, tuple(bool(getattr(p, a, False)) for a in ATTRIBUTES))
            for n, p in model.named_parameters()]


LAYOUTS = [  # (layout, rank, execution, dispatcher chain of every MoE layer)
    (_layout(), 0, MoEExecutionConfig(), [LocalDispatcher]),
    (_layout(ep=2, world=2), 1, MoEExecutionConfig(token_dispatcher_type="alltoall"),
     [AllToAllDispatcher]),
    (_layout(tp=2, ep=2, pp=2, world=8), 5, MoEExecutionConfig(),
     [TensorParallelDispatcher, AllGatherDispatcher]),
    (_layout(tp=2, etp=1, world=2), 1, MoEExecutionConfig(),
     [TensorParallelDispatcher, LocalDispatcher]),
    (_layout(ep=4, world=4), 2, MoEExecutionConfig(token_dispatcher_type="alltoall",
                                                   adaptive_parallelism=True),
     [AdaptiveDispatcher, AllToAllDispatcher]),
]


@pytest.mark.parametrize("parallel, rank, execution, chain", LAYOUTS)
def test_meta_model_parallelizes_to_the_shards_of_the_cpu_model(parallel, rank, execution,
                                                                 chain):
    with fake_rank(rank, parallel) as mesh:
        on_cpu = parallelize(GPTModel(CONFIG), mesh, parallel, execution, seed=1,
                             dtype=torch.bfloat16)
        with torch.device("meta"):
            on_meta = GPTModel(CONFIG)
        on_meta = parallelize(on_meta, mesh, parallel, execution, seed=1,
                              dtype=torch.bfloat16)
    assert _describe(on_meta) == _describe(on_cpu)
    assert all(p.is_meta for p in on_meta.parameters())
    for model in (on_cpu, on_meta):
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        assert layers
        for layer in layers:
            assert [type(d) for d in layer.dispatcher.inner_dispatchers()] == chain
    expert = next(m for m in on_cpu.modules() if isinstance(m, MoELayer)).experts
    assert expert.fc1_weight.shape[0] == 4 // parallel.expert_model_parallel_size
