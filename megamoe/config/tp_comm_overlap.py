"""What --tp-comm-overlap overlaps (Megatron-LM's tp_comm_* options of ModelParallelConfig),
as the tensor-parallel layers read it (megamoe/parallel/collective_matmul.py).

Megatron-LM runs this through Transformer Engine's userbuffers; megamoe builds the same
overlaps portably as "collective matmul" rings of torch.distributed point-to-point
operations and asynchronous collectives (docs/tp-comm-overlap.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPCommOverlap:
    """Which of the sequence-parallel linears' communications overlap their GEMMs.

    ag:         column forward all-gather and row backward all-gather, pipelined with the
                GEMM chunk by chunk (Megatron's tp_comm_overlap_ag).
    rs:         row forward reduce-scatter pipelined with the GEMM (tp_comm_overlap_rs).
    rs_dgrad:   column backward reduce-scatter of the input gradient pipelined with the
                dgrad GEMM (tp_comm_overlap_rs_dgrad; default off, as Megatron).
    bulk_wgrad: column backward re-gather of the input (for the weight gradient) in flight
                during the dgrad GEMM (tp_comm_bulk_wgrad).
    bulk_dgrad: column backward reduce-scatter of the input gradient in flight during the
                weight-gradient GEMM (tp_comm_bulk_dgrad; unused when rs_dgrad pipelines it).
    """

    ag: bool = True
    rs: bool = True
    rs_dgrad: bool = False
    bulk_wgrad: bool = True
    bulk_dgrad: bool = True
