"""Gradient accumulation: LM and MoE auxiliary losses reach the gradient once, scaled 1/n."""

from __future__ import annotations

import torch

from megamoe.config import ModelConfig, MoEConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.moe.experts import use_grouped_gemm
from megamoe.training.schedules.local import forward_backward_no_pipelining


def _model() -> GPTModel:
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=32, aux_loss_coeffs=[0.1],
                    z_loss_coeff=0.01)
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      seq_length=8, max_position_embeddings=8, vocab_size=50,
                      hidden_dropout=0.0, attention_dropout=0.0, swiglu=True,
                      add_bias_linear=False, normalization="RMSNorm",
                      position_embedding_type="rope", moe=moe)
    model = GPTModel(cfg)
    use_grouped_gemm(model, True)
    return model


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (2, 9), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "loss_mask": torch.ones(2, 8), "position_ids": torch.arange(8).expand(2, 8)}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulated_gradient_is_mean_of_microbatch_gradients():
    batches = [_batch(s) for s in range(3)]
    model = _model()
    model.zero_grad()
    loss = forward_backward_no_pipelining(model, iter(batches), 3)
    accumulated = _grads(model)

    singles, losses = [], []
    for b in batches:
        model.zero_grad()
        losses.append(forward_backward_no_pipelining(model, iter([b]), 1))
        singles.append(_grads(model))
    assert torch.allclose(loss, torch.stack(losses).mean(), atol=1e-6)
    router = [n for n in accumulated if "router" in n]
    assert router, "expected router weights (aux/z losses flow into them)"
    for name, g in accumulated.items():
        mean = torch.stack([s[name] for s in singles]).mean(0)
        torch.testing.assert_close(g, mean, atol=1e-6, rtol=1e-5, msg=name)


def test_aux_losses_change_router_gradient():
    """If aux/z losses did not reach the gradient the router grads would not depend on them."""
    b = _batch(7)
    grads = []
    for coeffs in ((0.0, None), (0.5, 0.1)):
        model = _model()
        for layer in model.modules():
            if hasattr(layer, "config") and isinstance(layer.config, MoEConfig):
                layer.config.aux_loss_coeffs = [coeffs[0]]
                layer.config.z_loss_coeff = coeffs[1]
        model.zero_grad()
        forward_backward_no_pipelining(model, iter([b]), 1)
        grads.append({n: g for n, g in _grads(model).items() if "router" in n})
    assert any(not torch.allclose(grads[0][n], grads[1][n]) for n in grads[0])
