"""--fp8-output-proj under --transformer-impl transformer_engine: the output layer's GEMM
on TE's Linear inside TE's autocast, as Megatron's TELMHeadColumnParallelLinear
(megatron/core/extensions/transformer_engine.py at d98e8a64): a TE column-parallel linear
whose forward runs under `get_fp8_context(config)`, the run's recipe (MXFP8: config/fp8.py
allows no other), for the LM head and the MTP depths' heads (Megatron's
process_mtp_loss calls the same output_layer).

TE's Linear computes with the head's own weight parameter (engine.py's `share`): the
untied output layer's, or the last pipeline stage's copy of the tied word embedding. It
multiplies every row of that table, padded rows included, as Megatron's head does (so
MXFP8's tiles along the vocabulary in dgrad see what Megatron's see); the logits of the
padded rows are dropped before the loss (their rows get a zero gradient), so the loss is
megamoe's as everywhere (model/gpt_model.py). Megatron's head keeps no extra state
(`get_extra_state` returns None): none is saved here either.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Optional

import torch
from torch import nn

from megamoe.model.te.engine import Engine, no_init, share
from megamoe.model.te.loader import TransformerEngine


def _leading_rows(rows: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether `rows` is the table itself or a view of its first rows (what lm_head
    multiplies: `w_VH[:vocab_size]`; under TP a rank whose rows are all padding gets
    `w_VH[:0]`, an empty view whose data_ptr() is 0)."""
    if rows is table:
        return True
    if rows._base is not table or rows.shape[1:] != table.shape[1:]:
        return False
    return rows.numel() == 0 or (rows.data_ptr() == table.data_ptr()
                                 and rows.stride() == table.stride())


class TeOutputGemm(Engine):
    """The output GEMM hook of a head module (`owner`: a GPTModel or last GPTStage) on
    TE's Linear over `weight` [padded_vocab, H], called inside `autocast()`."""

    def __init__(self, te: TransformerEngine, owner: nn.Module, weight: nn.Parameter,
                 autocast: Callable[[], ContextManager]) -> None:
        vocab, hidden = weight.shape
        module = te.pytorch.Linear(hidden, vocab, bias=False, params_dtype=weight.dtype,
                                   device=weight.device, init_method=no_init)
        share(module, "weight", weight)
        super().__init__(module, owner)
        self.autocast = autocast

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [..., H] -> logits [..., rows of `weight`] (a leading slice of the table)."""
        if bias is not None or not _leading_rows(weight, self.module.weight):
            raise RuntimeError("the output layer's weight was replaced after Transformer "
                               "Engine's Linear was installed on it")
        self.sync_mode()
        with self.autocast():
            logits = self.module(x.contiguous())
        return logits[..., : weight.shape[0]]
