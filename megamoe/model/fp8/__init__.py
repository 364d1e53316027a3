"""FP8 training on PyTorch's scaled matmuls (torch._scaled_mm): the quantisation formulas
(quantize.py), the per-tensor scaling state of each recipe (scaling.py), the FP8 linear's
autograd function (linear.py), the experts' FP8 grouped GEMM (grouped.py) and the policy
that applies it to a model (policy.py). docs/fp8.md says what is verified where."""
