"""Fake-device runs: the accelerator path's device placement, checked on a CPU machine.

Under torch's FakeTensorMode tensors carry shapes, dtypes and devices but no data; any op
that mixes a tensor of the stand-in accelerator with a CPU tensor (other than a 0-d
scalar, exactly ACCEL's rule) raises FakeTensorDeviceMismatchError, and reading a value
(.item(), .tolist(), a data-dependent shape) raises DataDependentOutputException. The
stand-in accelerator is the "meta" device: on this CPU build, fake "cuda:0" tensors fail
every copy-like op (clone, contiguous, copy_) in C++ ACCEL device guards before the fake
dispatch runs, while fake meta tensors behave as a GPU's would for everything checked here
(grouped_mm even insists on bf16, as on ACCEL). So everything below runs the real code with
this process standing in for an accelerator rank: a tensor created on the host by mistake
and mixed with the model's, or a host sync where none is allowed, fails the test. What
needs a value (the skip decision on the grad norm: the step's one host read) is left out:
the tests call the steps around it. MoE layers, whose dispatch sizes are data-dependent,
run under the same fake device in tests/moe/test_fake_device_moe.py with their host reads
replayed from a real CPU run.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensorDeviceMismatchError,
    FakeTensorMode,
)

from megamoe.config import (
    ModelConfig,
    MoEExecutionConfig,
    OptimizerConfig,
    ParallelConfig,
    RecomputeConfig,
)
from megamoe.model.gpt_model import GPTModel
from megamoe.parallel.mesh import single_process_mesh
from megamoe.parallelize import apply_recompute, parallelize
from megamoe.training.materialize import materialize
from megamoe.training.optim import build_optimizer
from megamoe.training.optim.distributed import DistributedOptimizer
from megamoe.training.optim.grad_scaler import unscale_and_check

ACCEL = torch.device("meta")  # the stand-in accelerator (module docstring)
DENSE = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, seq_length=16, max_position_embeddings=16,
                    vocab_size=97, normalization="RMSNorm", position_embedding_type="rope",
                    swiglu=True, hidden_dropout=0.0, attention_dropout=0.0)


def _fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


def _parallelized(config: ModelConfig, dtype: torch.dtype = torch.float32):
    """The trainer's build path up to materialisation (meta -> parallelize): shapes only,
    made outside the fake mode (FakeTensorMode cannot swap a module's fake parameters for
    a dtype cast; real meta tensors can, and hold nothing a device could disagree with)."""
    mesh = single_process_mesh(ACCEL)
    with torch.device("meta"):
        model = GPTModel(config)
    return parallelize(model, mesh, ParallelConfig(), MoEExecutionConfig(), seed=1,
                       dtype=dtype), mesh


def test_the_fake_mode_catches_what_it_must():
    with _fake_mode():
        a = torch.ones(3, 4, device=ACCEL)
        for mixed in (lambda: a + torch.ones(3, 4, device="cpu"),
                      lambda: a @ torch.ones(4, 2, device="cpu"),
                      lambda: a.index_select(0, torch.tensor([0, 1], device="cpu"))):
            with pytest.raises(FakeTensorDeviceMismatchError):
                mixed()
        with pytest.raises(DataDependentOutputException):
            a.sum().item()
        a + torch.tensor(2.0, device="cpu")  # a 0-d CPU scalar is allowed, as on CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_model_built_trained_and_stepped_on_the_device(dtype):
    model, mesh = _parallelized(DENSE, dtype)
    with _fake_mode():
        model = materialize(model, mesh, seed=1)
        assert all(t.device == ACCEL for t in model.state_dict().values())
        tokens = torch.randint(0, DENSE.vocab_size, (2, DENSE.seq_length), device=ACCEL)
        loss = model(tokens, labels=tokens).float().mean()
        loss.backward()
        opt = build_optimizer(model, OptimizerConfig(lr=1e-3, bf16=dtype == torch.bfloat16))
        grads = opt.main_grads()
        norm = opt.grad_norm_fn(grads)  # on the device; reading it is the step's one sync
        assert norm.device == ACCEL
        opt.clip_and_update(grads, norm)
        assert all(p.device == ACCEL for p in opt.main_params)
        for state in opt.optimizer.state.values():
            assert all(v.device == ACCEL for v in state.values() if torch.is_tensor(v)
                       and v.dim() > 0)


# --use-precision-aware-optimizer: fp16 (scaled) and bf16 moments, bf16 grad buffers
AWARE = dict(use_precision_aware_optimizer=True, exp_avg_dtype="fp16",
             exp_avg_sq_dtype="bf16", main_grads_dtype="bf16", bf16=True)


@pytest.mark.parametrize("dtype, aware", [(torch.float32, {}), (torch.bfloat16, {}),
                                          (torch.bfloat16, AWARE)],
                         ids=["fp32", "bf16", "bf16-precision-aware"])
def test_distributed_optimizer_buffers_and_step_on_the_device(dtype, aware):
    """--use-distributed-optimizer (one rank): flat parameter and grad buffers, main
    slices, the norm, clipping, AdamW's states (stored below fp32 and their scales, two
    steps) and the all-gather all on the device."""
    model, mesh = _parallelized(DENSE, dtype)
    with _fake_mode():
        model = materialize(model, mesh, seed=1)
        opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-3, clip_grad=1.0, **aware),
                                   tp_group=None, dp_group=None)
        for buf in opt.buffers:
            assert buf.param_buffer.device == ACCEL and buf.grad_buffer.device == ACCEL
        tokens = torch.randint(0, DENSE.vocab_size, (2, DENSE.seq_length), device=ACCEL)
        for _ in range(2 if aware else 1):  # (the second step reads the stored states)
            opt.zero_grad()
            model(tokens, labels=tokens).float().mean().backward()
            norm = opt.reduce_and_norm()
            assert norm.device == ACCEL and norm.dim() == 0
            opt.clip_and_update(norm)
        assert all(p.device == ACCEL for p in model.parameters())
        for state in opt.optimizer.state.values():
            assert all(v.device == ACCEL for v in state.values() if torch.is_tensor(v)
                       and v.dim() > 0)
        for scales in getattr(opt.optimizer, "scales", {}).values():
            assert all(s.device == ACCEL for s in scales.values())


def test_fp16_loss_scaling_stays_on_the_device():
    """--fp16: the scaled backward, the unscale and the overflow flag (found_inf) are on
    the device; the scale itself is a host number (no tensor to keep in step)."""
    model, mesh = _parallelized(DENSE, torch.float16)
    with _fake_mode():
        model = materialize(model, mesh, seed=1)
        opt = build_optimizer(model, OptimizerConfig(lr=1e-3, fp16=True))
        tokens = torch.randint(0, DENSE.vocab_size, (2, DENSE.seq_length), device=ACCEL)
        model(tokens, labels=tokens).float().mean().mul(opt.get_loss_scale()).backward()
        grads = opt.main_grads()
        found_inf = unscale_and_check(grads, opt.grad_scaler, ACCEL, agree=False)
        assert found_inf.device == ACCEL and all(g.device == ACCEL for g in grads)


def test_checkpoint_load_buffers_are_made_on_the_tensors_device():
    """The torch_dist loader asks DCP for buffers on the device of what they load into (a
    CPU buffer would be copied to the mesh's device by DTensor and the copy filled)."""
    from megamoe.training.checkpoint import dist as dist_ckpt
    from megamoe.training.checkpoint.sharded_state import model_entries

    model, mesh = _parallelized(DENSE)
    with _fake_mode():
        model = materialize(model, mesh, seed=1)
        entries = model_entries(model)
        part, like = entries[0].parts[0], entries[0].tensor
        meta = {part.key: _tensor_metadata(part.global_shape, like.dtype)}
        request, targets = {}, []
        dist_ckpt._request(meta, "ckpt", part.key, part, like, request, targets,
                           lambda buf: None)
        buf = request[part.key][1]
        assert buf.device == ACCEL and buf.shape == like.shape


def _tensor_metadata(shape, dtype):
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [])


@pytest.mark.parametrize("recompute", [
    RecomputeConfig(granularity="full", method="uniform", num_layers=1),
    RecomputeConfig(granularity="selective", modules=["core_attn", "mlp", "layernorm"])])
def test_recompute_replays_on_the_device(recompute):
    """Activation recompute's replay (checkpointed regions, output-discarding) makes and
    reads every tensor on the device: a host tensor in the replay fails here."""
    model, mesh = _parallelized(DENSE, torch.bfloat16)
    apply_recompute(model, recompute)
    with _fake_mode():
        model = materialize(model, mesh, seed=1)
        tokens = torch.randint(0, DENSE.vocab_size, (2, DENSE.seq_length), device=ACCEL)
        model(tokens, labels=tokens).float().mean().backward()
        assert all(p.grad is not None and p.grad.device == ACCEL for p in model.parameters())


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_fp8_primary_weights_cast_and_gather_on_the_device(recipe):
    """--fp8-param-gather (one rank): the FP8 byte buffers, the scales, the cast from the
    main shard, the forward on the cast weights and the delayed update all on the device,
    with no host read (training/optim/fp8_shards.py)."""
    from megamoe.config.fp8 import Fp8Config
    from megamoe.model.fp8.params import primary
    from megamoe.model.fp8.policy import apply_fp8
    from megamoe.training.optim.fp8_shards import Fp8FlatShards

    model, mesh = _parallelized(DENSE, torch.bfloat16)
    with _fake_mode():
        model = materialize(model, mesh, seed=1)
        fmt = "e4m3" if recipe == "blockwise" else "hybrid"
        state = apply_fp8(model, Fp8Config(format=fmt, recipe=recipe, param_gather=True),
                          ACCEL)
        opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-3, clip_grad=1.0, bf16=True),
                                   tp_group=None, dp_group=None)
        fp8 = [b for b in opt.buffers if isinstance(b, Fp8FlatShards)]
        assert fp8 and all(b.param_buffer.device == ACCEL for b in fp8)
        tokens = torch.randint(0, DENSE.vocab_size, (2, DENSE.seq_length), device=ACCEL)
        for _ in range(2):
            opt.zero_grad()
            model(tokens, labels=tokens).float().mean().backward()
            state.update()
            opt.clip_and_update(opt.reduce_and_norm())
        for b in fp8:
            for _, p in b.params:
                prim = primary(p)
                assert prim.data.device == ACCEL and prim.scale.device == ACCEL
