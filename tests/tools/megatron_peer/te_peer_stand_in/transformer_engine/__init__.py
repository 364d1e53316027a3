"""Transformer Engine stand-in for the megatron-core peer (tests only; see README.md).

Reproduced from TE v2.18.0 (commit 27486e03, the version it reports, so megatron-core
takes its TE >= 2.x paths): `pytorch.GroupedLinear`'s constructor and forward signatures
and its parameter REGISTRATION ORDER (transformer_engine/pytorch/module/grouped_linear.py
at 27486e03, lines 1450-1482: for i in range(num_gemms): `weight{i}` then, with bias,
`bias{i}`), which fixes where megatron-core's DDP puts each expert in its flat buffers;
the TP attributes it sets on them (lines 1616-1657). Not reproduced: TE's math (the
per-GEMM linears are plain torch F.linear on the fp32 parameters), FP8 (asked for, it
raises), and every other TE module: the names megatron-core's extension subclasses at
import exist, but building one raises NotImplementedError, so a peer run that would use
them fails loudly instead of running something that is not TE.
"""

__version__ = "2.18.0"

from transformer_engine import common, pytorch  # noqa: E402,F401  (as TE's __init__ does)
