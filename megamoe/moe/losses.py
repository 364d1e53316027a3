"""MoE balancing losses, how they reach the gradient, and how they are logged.

The auxiliary losses never enter the LM loss tensor. Each MoE layer attaches its loss to
its output with `attach_aux_loss`; the backward pass of that identity injects
d(aux)/d(aux) = scale, where the schedule sets scale = 1 / num_microbatches, so the aux
loss is scaled exactly like the LM loss and counted once per micro-batch. Under loss
scaling (--fp16) the schedule also passes the loss scale, which multiplies every injected
aux-loss gradient as the backward of the scaled LM loss is multiplied (Megatron's
MoEAuxLossAutoScaler.set_loss_scale(loss_scale / num_microbatches)): the unscaling of the
gradients then divides both alike.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

_AUX_LOSS_BACKWARD_SCALE: float = 1.0
_LOSS_SCALE: float = 1.0


def set_aux_loss_backward_scale(scale: float, loss_scale: float = 1.0) -> None:
    """Scale applied to every aux-loss gradient (the schedule passes 1/num_microbatches),
    and the step's loss scale (--fp16), which also multiplies an explicit backward_scale
    (attach_aux_loss): every gradient of the backward carries the loss scale."""
    global _AUX_LOSS_BACKWARD_SCALE, _LOSS_SCALE
    _AUX_LOSS_BACKWARD_SCALE = float(scale)
    _LOSS_SCALE = float(loss_scale)


class _AuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output` whose backward also feeds `scale` into the aux loss's graph."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor,
                scale: Optional[float]) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        scale = (_AUX_LOSS_BACKWARD_SCALE if ctx.scale is None else ctx.scale) * _LOSS_SCALE
        return grad_output, torch.ones_like(aux_loss) * scale, None


@torch.compiler.disable  # traced, the identity's extra gradient was lost (--compile)
def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor,
                    backward_scale: Optional[float] = None) -> torch.Tensor:
    """Return `output` unchanged; its backward adds scale * d(aux_loss) to the gradients
    (the scale read when the backward runs: the schedule sets it per step), or
    `backward_scale` when given (a loss already normalised for the whole step)."""
    return _AuxLossAutoScaler.apply(output, aux_loss, backward_scale)


def switch_load_balancing_loss(probs_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                               topk: int, coeff: float, shards: int = 1) -> torch.Tensor:
    """Switch/GShard loss E * coeff / (k * T^2) * sum_e P_e * count_e.

    `probs_TE` are the full (all-expert) router probabilities, `tokens_per_expert_E` the
    counts of the routing map actually dispatched. Perfect balance gives exactly coeff.

    `shards` > 1 (context parallelism): the tokens are one of `shards` equal parts of the
    sequences and `tokens_per_expert_E` the counts summed over all parts (T = shards x the
    local tokens). This rank's term P_e sums its own tokens only, so the terms of the parts
    add up to the whole sequences' loss (Megatron's tp_cp reduction); it is returned x
    `shards`, so the mean over the parts (logging) and the gradient average over dp x cp
    both give the whole sequences' loss, each token counted once.
    """
    num_tokens, num_experts = probs_TE.shape
    num_tokens *= shards
    p_E = probs_TE.sum(dim=0)
    counts_E = tokens_per_expert_E.to(p_E.dtype)
    scale = shards * num_experts * coeff / (topk * num_tokens * num_tokens)
    return (p_E * counts_E).sum() * scale


def sequence_load_balancing_loss(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor,
                                 seq_ids_T: torch.Tensor, num_seqs: int, topk: int,
                                 coeff: float, shards: int = 1,
                                 sum_counts: Optional[Callable[[torch.Tensor], torch.Tensor]]
                                 = None) -> torch.Tensor:
    """Mean over sequences of the Switch loss computed inside each sequence.

    `seq_ids_T` maps each token to its sequence, so any [S, B] / [B, S] flattening works.
    Averaging over sequences (not summing over the micro-batch) keeps the gradient
    independent of the micro-batch size (Megatron #5798). `shards` / `sum_counts`:
    each sequence split over `shards` context-parallel ranks, `sum_counts` summing the
    per-sequence counts over them; as in `switch_load_balancing_loss`, the result is this
    part's term x `shards`.
    """
    num_tokens, num_experts = probs_TE.shape
    seq_len = num_tokens // num_seqs
    if seq_len * num_seqs != num_tokens:
        raise ValueError(f"seq_aux_loss: {num_tokens} tokens are not {num_seqs} equal sequences")
    p_BE = probs_TE.new_zeros(num_seqs, num_experts).index_add(0, seq_ids_T, probs_TE)
    counts_BE = probs_TE.new_zeros(num_seqs, num_experts).index_add(
        0, seq_ids_T, routing_map_TE.to(probs_TE.dtype))
    if sum_counts is not None:
        counts_BE = sum_counts(counts_BE)
    seq_len *= shards
    scale = shards * num_experts * coeff / (topk * seq_len * seq_len)
    return (p_BE * counts_BE).sum(dim=-1).mean() * scale


def global_load_balancing_loss(probs_TE: torch.Tensor, global_fraction_E: torch.Tensor,
                               global_num_tokens: Union[int, torch.Tensor], topk: int,
                               coeff: float, grad_average_size: int = 1) -> torch.Tensor:
    """Switch loss with token fractions counted over the global batch so far.

    `global_fraction_E` = routed tokens per expert / tokens (all-reduced over tp-dp-cp and
    accumulated over the micro-batches seen in this global batch); the router
    probabilities are this rank's, divided by the micro-batch's token count over the whole
    group. The sum over ranks of these local losses is the global loss; multiplying by the
    size of the group that averages gradients (`grad_average_size`, dp x cp) makes the
    averaged gradient that of the global loss, not 1/DP of it (Megatron #3672).
    `global_num_tokens` may be a 0-d tensor on the device (the router's: no host sync).
    """
    num_experts = probs_TE.shape[1]
    p_E = probs_TE.sum(dim=0) / global_num_tokens
    scale = grad_average_size * num_experts * coeff / topk
    return (p_E * global_fraction_E.to(p_E.dtype)).sum() * scale


def z_loss(logits_TE: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE router z-loss coeff * mean_t(logsumexp(logits_t)^2): keeps logits small."""
    return coeff * torch.logsumexp(logits_TE, dim=-1).square().mean()


class MoELossTracker:
    """Process-wide per-layer accumulator of MoE loss values, for logging only."""

    _values: dict[str, dict[int, torch.Tensor]] = {}

    @classmethod
    def record(cls, name: str, layer_number: int, num_layers: int, value: torch.Tensor) -> None:
        """Add `value` (detached) to the slot of `layer_number` (0 <= layer < num_layers)."""
        if not 0 <= layer_number < num_layers:
            raise ValueError(f"layer_number {layer_number} outside [0, {num_layers})")
        slots = cls._values.setdefault(name, {})
        v = value.detach().to(torch.float32).reshape(())
        slots[layer_number] = slots[layer_number] + v if layer_number in slots else v.clone()

    @classmethod
    def report(cls, num_microbatches: int) -> dict[str, torch.Tensor]:
        """{name: [layers that recorded] of sum / num_microbatches}, ordered by layer, on
        the device the values were recorded on (no host read: the loop reads them with the
        other logged values on a logging iteration); clears."""
        out = {}
        for name, slots in cls._values.items():
            layers = sorted(slots)
            out[name] = torch.stack([slots[i] for i in layers]) / num_microbatches
        cls.clear()
        return out

    @classmethod
    def clear(cls) -> None:
        cls._values = {}
