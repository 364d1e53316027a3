"""GPTModel under tensor (+ sequence) parallelism equals the single-process model: init
(shards are slices), loss, every gradient after the TP reduction, and the grad norm."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megamoe.config import ModelConfig, MoEConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    shard_rows,
)
from megamoe.parallelize import apply_tensor_parallel, parallelize_moe
from megamoe.training.optim.grads import local_grad_norm, model_parallel_grad_norm, reduce_gradients
from tests.distributed import run_distributed

DENSE = dict(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4,
             seq_length=8, max_position_embeddings=8, vocab_size=37,
             make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0,
             init_method_std=0.2)
MOE = dict(DENSE, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
           add_bias_linear=False, num_query_groups=2, untie_embeddings_and_output_weights=True,
           vocab_size=21,  # padded 24: rank 0 has 12 real rows, rank 1 only 9
           moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=12, aux_loss_coeffs=[1e-2],
                         z_loss_coeff=1e-3),
           moe_layer_pattern=[0, 1])


def _expected_shard(name: str, full: torch.Tensor, module: torch.nn.Module, r: int, n: int
                    ) -> torch.Tensor:
    if isinstance(module, ColumnParallelLinear):
        return shard_rows(full, module.blocks, n, r)
    if isinstance(module, RowParallelLinear) and name.endswith("weight"):
        return full.chunk(n, dim=1)[r]
    if isinstance(module, VocabParallelEmbedding):
        return full.chunk(n)[r]
    return full


def _run(model: GPTModel, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = model(tokens, labels=labels)
    loss.mean().backward()
    return loss.detach()


def _model_worker(rank: int, world_size: int, kwargs: dict, sp: bool) -> dict:
    config = ModelConfig(**kwargs)
    group = dist.group.WORLD
    tokens = torch.randint(0, config.vocab_size, (3, config.seq_length),
                           generator=torch.Generator().manual_seed(11))
    labels = torch.randint(0, config.vocab_size, (3, config.seq_length),
                           generator=torch.Generator().manual_seed(12))
    torch.manual_seed(5)
    dense = GPTModel(config)
    torch.manual_seed(5)
    par = apply_tensor_parallel(GPTModel(config), TensorParallel(group, sequence_parallel=sp))
    # MoE layers: whole experts, the routed tokens split over the TP ranks (ETP = 1); their
    # gradients are then summed over the expert-data-parallel group, here the TP ranks.
    parallelize_moe(par, tp_group=group)
    modules = dict(par.named_modules())
    dense_params = dict(dense.named_parameters())
    ref_loss = _run(dense, tokens, labels)
    loss = _run(par, tokens, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    params = list(par.parameters())
    grads = [p.grad for p in params]
    reduce_gradients(grads, params, group, None, edp_group=group)
    checked = 0
    for name, p in par.named_parameters():
        module = modules[name.rsplit(".", 1)[0]]
        full = dense_params[name]
        torch.testing.assert_close(p.detach(), _expected_shard(name, full.detach(), module,
                                                               rank, world_size),
                                   msg=lambda m, n=name: f"init {n}: {m}")
        torch.testing.assert_close(p.grad, _expected_shard(name, full.grad, module, rank,
                                                           world_size),
                                   rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"grad {n}: {m}")
        checked += 1
    assert checked == len(dense_params)
    norm = model_parallel_grad_norm(grads, params, group, None)
    ref_norm = local_grad_norm([p.grad for p in dense.parameters()])
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
    with torch.no_grad():
        logits = par.eval()(tokens)
        ref_logits = dense.eval()(tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    return {"loss": float(loss.mean())}


def _cases_worker(rank: int, world_size: int, cases: list[tuple[dict, bool]]) -> None:
    for kwargs, sp in cases:
        _model_worker(rank, world_size, kwargs, sp)


def test_gpt_tp2_dense_and_moe_with_and_without_sequence_parallel():
    """Dense (LayerNorm, learned positions, biases, tied) without and with SP; MoE (RMSNorm,
    RoPE, GQA, swiglu, untied, uneven real vocab per rank, aux + z loss) with SP."""
    run_distributed(_cases_worker, 2, 180, [(DENSE, False), (DENSE, True), (MOE, True)])
