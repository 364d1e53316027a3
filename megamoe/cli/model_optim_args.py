"""Megatron-LM's model-variant and parameter-group flags that its own model configs pass
(Llama, Nemotron, Qwen3-Next, ...): the MLP activation, the rotary pair order and Llama 3
scaling, which norms decay, and a separate learning rate for the embedding and output
layer. Each has
Megatron-LM's meaning (the config field that each sets says which, and where Megatron
computes it); the rotary and norm flags megamoe has not built are parsed here to be
refused with "not supported yet" (config/unsupported.py).
"""

from __future__ import annotations

import argparse

from megamoe.cli.value_types import finite_float


def add_model_optim_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model variants (Megatron-LM's)")
    g.add_argument("--squared-relu", action="store_true",
                   help="MLP activation relu(x)^2 instead of gelu (not with --swiglu)")
    g.add_argument("--quick-geglu", action="store_true",
                   help="gated MLP: quick_gelu(gate) * up, quick_gelu(x) = x sigmoid(1.702x) "
                        "(not with --swiglu; --ffn-hidden-size default stays 4 x hidden)")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="exact erf GELU in biased GELU MLPs (default: Megatron's fused "
                        "bias-GELU, the tanh approximation)")
    g.add_argument("--openai-gelu", action="store_true",
                   help="accepted, no effect: Megatron-LM parses it and never reads it")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE on the channel pairs (x0, x1), (x2, x3), ... instead of the "
                        "two halves (not with --multi-latent-attention)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x RoPE frequency scaling (standard attention)")
    g.add_argument("--rope-scaling-factor", type=finite_float, default=8.0,
                   help="its factor (Megatron's default 8)")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None)
    g.add_argument("--apply-layernorm-1p", action="store_true")
    g = parser.add_argument_group("parameter groups (Megatron-LM's)")
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                   help="weight decay on the q/k layernorm weights too (other norms and "
                        "biases have none)")
    g.add_argument("--no-weight-decay-cond-type", default=None,
                   choices=["apply_wd_to_qk_layernorm"],
                   help="deprecated spelling of --apply-wd-to-qk-layernorm")
    g.add_argument("--decoupled-lr", type=finite_float, default=None,
                   help="peak learning rate of the word embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=finite_float, default=None,
                   help="their minimum learning rate (default --min-lr)")
