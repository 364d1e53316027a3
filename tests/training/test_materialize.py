"""A model built on the meta device and materialised on one rank of a layout holds exactly
the single-process values at its shards' global positions (values depend on --seed and
the position only), for TP+SP, PP, EP and ETP, in bf16 and fp32; --use-cpu-initialization
gives the same values; the draws look like the initialisation they replace."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megamoe.config import MoEExecutionConfig, ParallelConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.parallel.mesh import single_process_mesh
from megamoe.parallelize import parallelize
from megamoe.training.checkpoint.sharded_state import model_entries
from megamoe.training.materialize import materialize
from tests.test_parallelize import CONFIG, fake_rank

SEED = 5


def _single_process() -> dict[str, torch.Tensor]:
    """{logical key: whole tensor} of the single-process materialised model."""
    with torch.device("meta"):
        model = GPTModel(CONFIG)
    materialize(model, single_process_mesh(torch.device("cpu")), SEED)
    return {p.key: p.local(e.tensor) for e in model_entries(model) for p in e.parts}


def _region(full: torch.Tensor, part, local: torch.Tensor) -> torch.Tensor:
    """The part's region of the logical tensor, placed by torch's own DTensor arithmetic
    (independent of materialize's)."""
    offsets = [0] * local.dim()
    if part.device_mesh is not None:
        _, offsets = compute_local_shape_and_global_offset(part.global_shape,
                                                           part.device_mesh, part.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))]


LAYOUTS = [  # (layout, rank)
    (ParallelConfig.layout(2, tp=2), 1),
    (ParallelConfig.layout(8, tp=2, ep=2, pp=2), 5),
    (ParallelConfig.layout(4, tp=2, ep=2, etp=1), 3),
    (ParallelConfig.layout(4, pp=2, ep=2), 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parallel, rank", LAYOUTS)
def test_every_shard_holds_the_single_process_values(parallel, rank, dtype):
    parallel.sequence_parallel = parallel.tensor_model_parallel_size > 1
    single = _single_process()
    with fake_rank(rank, parallel) as mesh:
        with torch.device("meta"):
            model = GPTModel(CONFIG)
        model = parallelize(model, mesh, parallel, MoEExecutionConfig(), seed=SEED,
                            dtype=dtype)
        materialize(model, mesh, SEED)
        entries = model_entries(model, mesh)
        assert not any(t.is_meta for t in model.state_dict().values())
        checked = 0
        for e in entries:
            for part in e.parts:
                local = part.local(e.tensor)
                want = _region(single[part.key], part, local)
                assert torch.equal(local, want.to(dtype)), part.key
                checked += 1
    assert checked >= 20


def test_host_initialization_gives_the_same_values():
    mesh = single_process_mesh(torch.device("cpu"))
    built = []
    for on_host in (False, True):
        with torch.device("meta"):
            model = GPTModel(CONFIG)
        built.append(materialize(model, mesh, SEED, on_host=on_host).state_dict())
    assert all(torch.equal(built[0][k], built[1][k]) for k in built[0])


def test_draws_are_the_initialisation_they_replace():
    """normal(0, init_method_std) weights (output layers scaled), norms 1, biases 0; another
    seed gives other values; rows of one tensor differ."""
    single = _single_process()
    fc1 = single["decoder.layers.1.mlp.experts.fc1_weight.gate"]
    assert abs(fc1.std().item() / CONFIG.init_method_std - 1) < 0.05
    out_std = CONFIG.init_method_std / (2.0 * CONFIG.num_layers) ** 0.5
    assert abs(single["decoder.layers.0.self_attention.linear_proj.weight"].std().item()
               / out_std - 1) < 0.1
    assert torch.equal(single["decoder.layers.0.input_layernorm.weight"],
                       torch.ones(CONFIG.hidden_size))
    assert not torch.equal(fc1[0], fc1[1])
    with torch.device("meta"):
        other = GPTModel(CONFIG)
    materialize(other, single_process_mesh(torch.device("cpu")), SEED + 1)
    assert not torch.equal(other.embedding.word_embeddings.weight,
                           single["embedding.word_embeddings.weight"])
