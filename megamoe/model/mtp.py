"""Multi-token prediction (DeepSeek-V3 MTP; Megatron's --mtp-num-layers and
--mtp-loss-scaling-factor, megatron/core/transformer/multi_token_prediction.py).

D = --mtp-num-layers modules run after the decoder (on the last pipeline stage). Module k
(0-based depth) takes the previous depth's hidden states h (the decoder's output after its
final norm for k = 0) and the embedding of the tokens shifted left by k + 1, and predicts
the token k + 2 places ahead:

    h_k = final_norm_k(layer_k(eh_proj_k(cat(enorm_k(emb(roll(tokens, k + 1))),
                                               hnorm_k(h_{k-1})))))
    loss_k = CE(output_head(h_k), roll(labels, k + 1)), masked by roll(loss_mask, k + 1)

`roll` is Megatron's roll_tensor: shift left by one along the sequence per depth, the
vacated last positions filled with zeros (a zero loss mask there), position ids rolled
alike; the decoder's RoPE table and document mask are reused unchanged, as in Megatron.
Under context parallelism (`cp` set by parallelize) the sequence is the load-balanced
split (rank r holds chunks r and 2CP-1-r): each chunk's shifted-in tail is the head of the
chunk after it in the whole sequence (rank r+1's first chunk, rank r-1's second, or for
rank CP-1 its own second chunk; zeros after the last chunk). One all-gather of every
rank's chunk heads (D tokens each, no autograd) brings them, for all depths at once.

`layer_k` is one transformer layer of the decoder's last layer's kind (MoE or dense),
numbered num_layers + k (its MoE losses are logged as that layer's). The word embedding
and the output head are the model's own (tied or not), so their gradients
collect the MTP terms too.

The loss of depth k is the masked mean over its micro-batch's tokens (under CP over the
whole sequence, as the LM loss: parallel/context_parallel.cp_masked_mean); the model adds
(mtp_loss_scaling_factor / D) * sum_k loss_k to the gradient only (the autoscaler the MoE
aux losses use: scaled by 1 / num_microbatches like the LM loss), never to the returned LM
loss; each loss_k is recorded for logging as "mtp_{k+1} loss" (MTPLossTracker). With
--calculate-per-token-loss the schedule passes `token_scales_D` = (dp x cp) / N_k, N_k the
step's unmasked tokens of depth k over the global batch (training/loss.py): loss_k is then
this micro-batch's masked sum x that scale, attached unscaled, so the step's MTP loss of
depth k is its per-token mean over the global batch, exactly; Megatron's version
approximates it with local counts. MTP runs in training forwards only: evaluation reports
the LM loss, which MTP does not change.

Names, for checkpoint conversion: `mtp.layers.{k}.{enorm, hnorm, eh_proj,
transformer_layer, final_layernorm}` = Megatron's names = DeepSeek-V3's HF
`model.layers.{num_hidden_layers + k}.{enorm, hnorm, eh_proj, <decoder layer>,
shared_head.norm}`; eh_proj.weight is [H, 2H] with the embedding half first, as both.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megamoe.config import ModelConfig
from megamoe.model.attention import DocumentMask
from megamoe.model.norms import build_norm
from megamoe.model.transformer_block import TransformerLayer
from megamoe.moe.losses import attach_aux_loss
from megamoe.parallel.checkpointing import maybe_checkpoint
from megamoe.parallel.comm import all_gather_no_grad, gather_from_sequence, scatter_to_sequence
from megamoe.parallel.context_parallel import cp_masked_mean
from megamoe.parallel.tensor_parallel import SINGLE, ColumnParallelLinear, TensorParallel

Rotary = Optional[tuple[torch.Tensor, torch.Tensor]]


class MTPLossTracker:
    """Process-wide sum over micro-batches of each depth's MTP loss (logging only)."""

    _values: Optional[torch.Tensor] = None  # [D] fp32, on the device

    @classmethod
    def record(cls, depth: int, num_depths: int, value: torch.Tensor) -> None:
        if cls._values is None or cls._values.numel() != num_depths:
            cls._values = torch.zeros(num_depths, dtype=torch.float32, device=value.device)
        cls._values[depth] += value.detach().float()

    @classmethod
    def take(cls) -> Optional[torch.Tensor]:
        """The sums so far ([D]) or None; clears."""
        values, cls._values = cls._values, None
        return values

    @classmethod
    def put(cls, values: torch.Tensor) -> None:
        """Replace the sums (the pipeline schedule's, summed over the stages)."""
        cls._values = values

    @classmethod
    def means(cls, num_microbatches: int) -> dict[str, torch.Tensor]:
        """{"mtp_1 loss": the step's mean over its micro-batches, ...} as float64 device
        scalars (no host read: the loop batches every logged value into one); clears."""
        values = cls.take()
        if values is None:
            return {}
        return {f"mtp_{k + 1} loss": v / num_microbatches
                for k, v in enumerate(values.double().unbind())}


def shifted(x_XS: torch.Tensor, num_shifts: int, cp: Optional[tuple] = None
            ) -> list[torch.Tensor]:
    """[x shifted left by 1, ..., by `num_shifts`] along the last (sequence) dim: Megatron's
    roll_tensor(shifts=-1) applied k times, zeros past the sequence's end. `cp` = (group,
    rank, size): x is this rank's load-balanced part [A | B] (module docstring)."""
    if cp is None or cp[2] == 1:
        tail = torch.zeros_like(x_XS[..., :num_shifts])
        return [torch.cat([x_XS[..., s:], tail[..., :s]], dim=-1)
                for s in range(1, num_shifts + 1)]
    group, rank, size = cp
    a, b = x_XS.chunk(2, dim=-1)
    heads = all_gather_no_grad(torch.stack([a[..., :num_shifts], b[..., :num_shifts]])[None],
                               group)  # [CP, 2, ..., D]: every rank's chunk heads
    next_a = heads[rank + 1, 0] if rank + 1 < size else b[..., :num_shifts]
    next_b = heads[rank - 1, 1] if rank > 0 else torch.zeros_like(b[..., :num_shifts])
    return [torch.cat([a[..., s:], next_a[..., :s], b[..., s:], next_b[..., :s]], dim=-1)
            for s in range(1, num_shifts + 1)]


class MTPLayer(nn.Module):
    """One MTP module (one depth); [S(/TP), B, H] hidden + embedding in, hidden out."""

    def __init__(self, config: ModelConfig, depth: int):
        super().__init__()
        h = config.hidden_size
        self.tp: TensorParallel = SINGLE
        self.depth = depth
        self.enorm = build_norm(config, h)
        self.hnorm = build_norm(config, h)
        # Column-parallel as Megatron's: output features split over TP, then gathered.
        self.eh_proj = ColumnParallelLinear(2 * h, h, bias=False,
                                            init_std=config.init_method_std)
        self.transformer_layer = TransformerLayer(config, config.num_layers + depth)
        self.final_layernorm = build_norm(config, h)
        self.recompute = False  # --recompute-granularity full (uniform), as Megatron's

    def forward(self, h_SBH: torch.Tensor, e_SBH: torch.Tensor, rotary: Rotary,
                docs: Optional[DocumentMask]) -> torch.Tensor:
        return maybe_checkpoint(self.recompute, self._forward, h_SBH, e_SBH, rotary, docs)

    def _forward(self, h_SBH: torch.Tensor, e_SBH: torch.Tensor, rotary: Rotary,
                 docs: Optional[DocumentMask]) -> torch.Tensor:
        x_SBH = torch.cat([self.enorm(e_SBH), self.hnorm(h_SBH)], dim=-1)
        x_SBH = self.eh_proj(x_SBH)  # [S, B, H / TP] under TP (whole sequence with SP)
        if self.tp.size > 1:
            # The hidden slices of every rank, then (SP) this rank's sequence shard. The
            # consumer is replicated, so the gather's backward keeps the local slice.
            x_HSB = gather_from_sequence(x_SBH.movedim(-1, 0).contiguous(), self.tp.group,
                                         reduce_grad=False)
            x_SBH = x_HSB.movedim(0, -1).contiguous()
            if self.tp.sp:
                x_SBH = scatter_to_sequence(x_SBH, self.tp.group)
        x_SBH = self.transformer_layer(x_SBH, rotary, docs)
        return self.final_layernorm(x_SBH)


class MultiTokenPrediction(nn.Module):
    """The D MTP modules (Megatron's MultiTokenPredictionBlock)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MTPLayer(config, k) for k in range(config.mtp_num_layers))
        self.cp: Optional[tuple] = None  # (group, rank, size): parallelize, under CP

    def forward(self, h_SBH: torch.Tensor, tokens_BS: torch.Tensor,
                position_ids: Optional[torch.Tensor], labels_BS: torch.Tensor,
                loss_mask_BS: Optional[torch.Tensor], embed: Callable, head: Callable,
                rotary: Rotary, docs: Optional[DocumentMask],
                token_scales_D: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The scaled MTP loss (a 0-d fp32 tensor to attach to the LM loss's graph); each
        depth's loss is recorded for logging. `h_SBH`: the decoder's output after its final
        norm; `embed(tokens, position_ids)` the model's embedding ([S(/TP), B, H]);
        `head(h, labels)` the per-token loss [B, S] through the model's output layer;
        `token_scales_D`: --calculate-per-token-loss (module docstring)."""
        num_depths = len(self.layers)
        mask_BS = (torch.ones_like(labels_BS, dtype=torch.float32) if loss_mask_BS is None
                   else loss_mask_BS.to(torch.float32))
        if position_ids is None and self.config.position_embedding_type == "learned_absolute":
            position_ids = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
        ids = [tokens_BS, labels_BS] + ([] if position_ids is None
                                        else [position_ids.expand_as(tokens_BS)])
        ids_per_depth = shifted(torch.stack([t.long() for t in ids]), num_depths, self.cp)
        masks = shifted(mask_BS, num_depths, self.cp)
        total = torch.zeros((), dtype=torch.float32, device=h_SBH.device)
        for k, layer in enumerate(self.layers):
            tokens_k, labels_k, *positions_k = ids_per_depth[k].unbind(0)
            h_SBH = layer(h_SBH, embed(tokens_k, positions_k[0] if positions_k else None),
                          rotary, docs)
            loss = self._depth_loss(head(h_SBH, labels_k), masks[k],
                                    None if token_scales_D is None else token_scales_D[k])
            MTPLossTracker.record(k, num_depths, loss)
            total = total + loss
        return total * (self.config.mtp_loss_scaling_factor / num_depths)

    def _depth_loss(self, loss_BS: torch.Tensor, mask_BS: torch.Tensor,
                    token_scale: Optional[torch.Tensor]) -> torch.Tensor:
        """One depth's loss: per-token (masked sum x the step's scale), or the masked mean
        over the micro-batch (the whole sequence under CP)."""
        if token_scale is not None:
            return (loss_BS.float() * mask_BS).sum() * token_scale
        if self.cp is not None:
            return cp_masked_mean(loss_BS, mask_BS, self.cp[0], self.cp[2])
        return (loss_BS.float() * mask_BS).sum() / mask_BS.sum().clamp(min=1.0)


def with_mtp_loss(mtp: Optional[MultiTokenPrediction], loss_BS: torch.Tensor,
                  h_SBH: torch.Tensor, tokens_BS: torch.Tensor,
                  position_ids: Optional[torch.Tensor], labels: Optional[torch.Tensor],
                  loss_mask: Optional[torch.Tensor], embed: Callable, head: Callable,
                  rotary: Rotary, docs: Optional[DocumentMask],
                  token_scales_D: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`loss_BS` (the per-token LM loss, unchanged) carrying the MTP loss into the
    gradient, when the model has MTP, is training and has labels; else `loss_BS`.
    `token_scales_D` (--calculate-per-token-loss): the loss is already the step's share,
    so it is attached unscaled rather than x 1 / num_microbatches."""
    if mtp is None or labels is None or not mtp.training:
        return loss_BS
    scaled = mtp(h_SBH, tokens_BS, position_ids, labels, loss_mask, embed, head, rotary, docs,
                 token_scales_D)
    return attach_aux_loss(loss_BS, scaled, None if token_scales_D is None else 1.0)
