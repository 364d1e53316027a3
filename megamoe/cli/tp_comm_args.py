"""--tp-comm-overlap and its sub-flags, with Megatron-LM's names and defaults (generated
there from megatron-core's ModelParallelConfig tp_comm_* fields: a store_false field is
--no-X and --disable-X). What they do: config/tp_comm_overlap.py and
parallel/collective_matmul.py (docs/tp-comm-overlap.md).

Built: --tp-comm-overlap, the ag / rs / rs-dgrad overlaps and the bulk dgrad / wgrad
overlaps. Refused ("not supported yet", config/unsupported.py): the flags that only
configure Transformer Engine's userbuffers (--tp-comm-overlap-cfg, the bootstrap backend,
and the split-vs-atomic choice TE >= 1.6 deprecated), which megamoe does not use.
"""

from __future__ import annotations

import argparse

from megamoe.config import ConfigError

# (Megatron's field, what disabling it turns off)
_DISABLE = (("overlap_ag", "the all-gather / GEMM pipelining (column forward, row backward)"),
            ("overlap_rs", "the GEMM / reduce-scatter pipelining of the row forward"),
            ("bulk_wgrad", "the column backward's input re-gather during the dgrad GEMM"),
            ("bulk_dgrad", "the column backward's dgrad reduce-scatter during the wgrad GEMM"))
REFUSED = ("--tp-comm-overlap-cfg", "--tp-comm-bootstrap-backend", "--no-tp-comm-split-ag",
           "--disable-tp-comm-split-ag", "--no-tp-comm-split-rs", "--disable-tp-comm-split-rs")


def add_tp_comm_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tensor-parallel communication overlap (Megatron-LM's)")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="overlap the sequence-parallel linears' all-gathers and "
                        "reduce-scatters with their GEMMs (collective matmul rings; needs "
                        "--sequence-parallel and TP > 1; no Transformer Engine needed)")
    for name, what in _DISABLE:
        flag = name.replace("_", "-")
        g.add_argument(f"--no-tp-comm-{flag}", f"--disable-tp-comm-{flag}",
                       dest=f"tp_comm_{name}", action="store_false",
                       help=f"with --tp-comm-overlap: turn off {what}")
    g.add_argument("--tp-comm-overlap-rs-dgrad", action="store_true",
                   help="with --tp-comm-overlap: pipeline the column backward's dgrad GEMM "
                        "with its reduce-scatter (instead of the bulk overlap)")
    g.add_argument("--tp-comm-overlap-cfg", default=None,
                   help="Transformer Engine userbuffer config: not supported yet")
    g.add_argument("--tp-comm-bootstrap-backend", default="nccl",
                   choices=["nccl", "mpi", "gloo"],
                   help="Transformer Engine userbuffer bootstrap: not supported yet")
    for flag in REFUSED[2:]:
        g.add_argument(flag, action="store_true",
                       help="Transformer Engine's split/atomic choice: not supported yet")


def check_tp_comm_args(args: argparse.Namespace) -> None:
    """The combinations the collective matmul does not run (one line each)."""
    if not args.tp_comm_overlap:
        return
    if args.fp8_format is not None:
        raise ConfigError("not supported yet: --tp-comm-overlap with --fp8-format (the "
                          "collective matmul runs high-precision GEMMs)")
    if getattr(args, "compile", False):
        raise ConfigError("not supported yet: --tp-comm-overlap with --compile")
