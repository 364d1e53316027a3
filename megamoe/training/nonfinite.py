"""--check-for-nan-in-loss-and-grad (Megatron's default: on): a NaN or Inf in a rank's loss
or in its own gradients stops the run before the optimizer step, on every rank, with one
line naming the iteration and the first rank that saw it.

As in Megatron, each rank checks what it computed itself, before anything is reduced: its
LM loss (pretrain_gpt.py's loss_func; only the last pipeline stage has one) and the norm
of its local gradients (the DDP buckets' check before the data-parallel collective), so
the rank named is the one where the NaN arose, not every rank the reduction spread it to.
The two verdicts are agreed over all ranks with one small all-reduce (MIN over
[rank or world size]), and the optimizer reads them together with the gradient norm it
reads anyway: the check adds no device->host synchronisation to a step.

With --no-check-for-nan-in-loss-and-grad a non-finite step is skipped instead (the
optimizer's non-finite grad norm rule; counted in the log line's skipped and nan
iterations). As in Megatron, --fp16 with dynamic loss scaling turns the check off:
overflowing gradients are the loss scaler's signal there (cli/rules.py), and the step is
skipped while the scale backs off (training/optim/grad_scaler.py). With a constant
--loss-scale the check stays on and, as in Megatron, stops the run first.

With the check on, the parameters are also checked after the update on the iterations
that save (check_params_before_save): no checkpoint is ever written holding NaN/Inf weights.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

OFF_FLAG = "--no-check-for-nan-in-loss-and-grad"


@torch.no_grad()
def check_params_before_save(params: Iterable[torch.Tensor], iteration: int, rank: int,
                             world_size: int, device: torch.device) -> None:
    """Before a checkpoint is written (every rank calls it): NonFiniteError on every rank
    if any rank's parameters hold a NaN/Inf after the update, so no checkpoint ever holds
    them (an update can overflow even when the loss and the gradients it came from were
    finite). Elementwise isfinite, not a norm, which would overflow on large finite
    weights. Its one host read is on saving iterations only."""
    bad = torch.zeros((), dtype=torch.bool, device=device)
    for p in params:
        bad |= ~torch.isfinite(p.detach()).all().to(device)
    first = torch.where(bad, rank, world_size).float().reshape(1)
    if world_size > 1:
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
    found = int(first.item())
    if found < world_size:
        raise NonFiniteError(f"iteration {iteration}: NaN/Inf in the parameters after the "
                             f"update on rank {found}; no checkpoint written ({OFF_FLAG} "
                             "saves them anyway)")


class NonFiniteError(RuntimeError):
    """A NaN/Inf in the loss or the gradients with the check on; the message names the
    iteration and the rank. Raised on every rank, before the optimizer step."""


class NonFiniteCheck:
    """One training step's check on this rank: `loss` is this rank's LM loss (None where
    the rank holds no loss: not the last pipeline stage); the optimizer hands its local
    gradients to `see_grads` before reducing them, then `read` instead of reading the
    norm alone."""

    def __init__(self, iteration: int, rank: int, world_size: int,
                 loss: Optional[torch.Tensor], device: torch.device) -> None:
        self.iteration, self.rank, self.world_size = iteration, rank, world_size
        self.loss_bad = (torch.zeros((), dtype=torch.bool, device=device) if loss is None
                         else ~torch.isfinite(loss.detach().float()))
        self.grads_bad = torch.zeros((), dtype=torch.bool, device=device)

    @torch.no_grad()
    def see_grads(self, grads: list[torch.Tensor]) -> None:
        """This rank's gradients before any reduction: is their norm finite (on the
        device, no sync; one fused norm pass, as Megatron's per-bucket check)?"""
        if grads:
            norms = torch._foreach_norm(grads)
            total = torch.stack([n.float() for n in norms]).sum()
            self.grads_bad = ~torch.isfinite(total.to(self.grads_bad.device))

    def see_local_verdict(self, bad: torch.Tensor) -> None:
        """The verdict on this rank's gradients taken before each bucket's collective
        (--overlap-grad-reduce: they are reduced during the backward; overlap.py)."""
        self.grads_bad = bad.to(self.grads_bad.device)

    def _agreed(self) -> torch.Tensor:
        """[first rank with a bad loss, first rank with bad gradients] (the world size
        where none), the same on every rank: one all-reduce over all ranks."""
        first = torch.where(torch.stack([self.loss_bad, self.grads_bad]), self.rank,
                            self.world_size).float()
        if self.world_size > 1:
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        return first

    def read(self, norm: torch.Tensor, found_inf: Optional[torch.Tensor] = None,
             riders: Optional[Riders] = None) -> tuple[float, bool]:
        """(the global gradient norm, the loss scaler's overflow flag `found_inf`: False
        without one), read in the same host sync as the agreed verdict (and `riders`);
        raises NonFiniteError (on every rank) when a rank saw a NaN/Inf."""
        values = _read_with(torch.cat([_row(norm, found_inf), self._agreed()]), riders)
        loss_rank, grads_rank = int(values[2]), int(values[3])
        if loss_rank < self.world_size:
            raise NonFiniteError(self._message("the loss", loss_rank))
        if grads_rank < self.world_size:
            raise NonFiniteError(self._message("the gradients", grads_rank))
        return values[0], values[1] > 0

    def _message(self, what: str, rank: int) -> str:
        return (f"iteration {self.iteration}: NaN/Inf in {what} on rank {rank}, before the "
                f"optimizer step ({OFF_FLAG} skips such steps instead)")


def _row(norm: torch.Tensor, found_inf: Optional[torch.Tensor]) -> torch.Tensor:
    """[norm, found_inf (0 without a loss scaler)] as one fp32 tensor on the norm's device."""
    flag = (torch.zeros(1, dtype=torch.float32, device=norm.device) if found_inf is None
            else found_inf.detach().float().reshape(1).to(norm.device))
    return torch.cat([norm.detach().float().reshape(1), flag])


class Riders:
    """Per-step device values that must reach the host every step (--check-for-spiky-loss:
    the micro-batch losses) and ride along the optimizer's verdict read instead of a read
    of their own; `values` holds them after the step's read."""

    def __init__(self, values: torch.Tensor) -> None:
        self.tensor = values.detach().reshape(-1).float()
        self.values: list[float] = []


def _read_with(row: torch.Tensor, riders: Optional[Riders]) -> list[float]:
    """`row` and the riders' values in one host read; the riders get theirs."""
    if riders is None:
        return row.tolist()
    values = torch.cat([row, riders.tensor.to(row.device)]).tolist()
    riders.values = values[row.numel():]
    return values[:row.numel()]


def read_grad_norm(norm: torch.Tensor, check: Optional[NonFiniteCheck],
                   found_inf: Optional[torch.Tensor] = None,
                   riders: Optional[Riders] = None) -> tuple[float, bool]:
    """The optimizer's one host read of a step: (the norm, whether the loss scaler's
    `found_inf` says a rank overflowed), with the check's verdict and the `riders`."""
    if check is not None:
        return check.read(norm, found_inf, riders)
    norm_value, flag = _read_with(_row(norm, found_inf), riders)
    return norm_value, flag > 0
