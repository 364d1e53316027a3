"""The megatron-core side of tests/tools/test_gelu_vs_megatron.py: megatron-core's MLP
(transformer/mlp.py, local ColumnParallelLinear / RowParallelLinear) with biases and GELU,
bias_activation_fusion on (what Megatron-LM's default bias_gelu_fusion gives: the fused
bias_gelu_impl, tanh GELU) and off (erf GELU). Runs in the peer venv, never imports megamoe.

    python peer_gelu.py --out OUT.pt
        writes, per fusion setting, the MLP's parameters, the input, the output and the
        gradients of sum(output * G) for the input and every parameter
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

torch.cuda.current_device = lambda: torch.device("cpu")
torch.cuda.synchronize = lambda *a, **k: None
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer import init_process_group  # noqa: E402  (the patches above come first)

H, F, S, B = 16, 24, 5, 2


def run(fusion: bool) -> dict:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=F,
                               num_attention_heads=2, add_bias_linear=True,
                               bias_activation_fusion=fusion, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True,
                               params_dtype=torch.float32, gradient_accumulation_fusion=False,
                               init_method_std=0.5)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                    linear_fc2=RowParallelLinear), ffn_hidden_size=F)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in mlp.parameters():  # biases start at zero: make them count
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(S, B, H, generator=gen).requires_grad_(True)
    g = torch.randn(S, B, H, generator=gen)
    out, out_bias = mlp(x)  # fc2's bias comes back unadded (skip_bias_add)
    y = out + out_bias
    params = dict(mlp.named_parameters())
    grads = torch.autograd.grad((y * g).sum(), [x, *params.values()])
    return {"params": {k: v.detach() for k, v in params.items()}, "x": x.detach(), "g": g,
            "y": y.detach(), "grads": dict(zip(["x", *params], grads))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    init_process_group()
    torch.save({"fused": run(True), "unfused": run(False)}, a.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
