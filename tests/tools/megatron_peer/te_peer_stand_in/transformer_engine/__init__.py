"""Transformer Engine stand-in for the megatron-core peer (tests only; see README.md).

Reproduced from TE v2.18.0 (commit 27486e03, the version it reports, so megatron-core
takes its TE >= 2.x paths): `pytorch.GroupedLinear`'s constructor and forward signatures
and its parameter REGISTRATION ORDER (transformer_engine/pytorch/module/grouped_linear.py
at 27486e03, lines 1450-1482: for i in range(num_gemms): `weight{i}` then, with bias,
`bias{i}`), which fixes where megatron-core's DDP puts each expert in its flat buffers;
the TP attributes it sets on them (lines 1616-1657); likewise `pytorch.Linear`,
`LayerNormLinear`, `RMSNorm`, `LayerNorm` and `DotProductAttention` (pytorch/dense.py,
each citing its TE lines), so that megatron-core builds its whole TE spec. Not
reproduced: TE's math (plain torch: F.linear, the norm in fp32, softmax attention; TE's
TP communication as torch.distributed autograd functions), FP8 (asked for, it raises),
any TE feature not listed in a module's docstring (it raises), and LayerNormMLP (a name
only: building it raises), so a peer run that would use them fails loudly instead of
running something that is not TE.
"""

__version__ = "2.18.0"

from transformer_engine import common, pytorch  # noqa: E402,F401  (as TE's __init__ does)
