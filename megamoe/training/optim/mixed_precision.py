"""The optimizer wrapper: fp32 main parameters, fp32 gradient accumulation, clipping, skip.

With --bf16 (or --fp16) the model holds bf16 (fp16) parameters; Adam must not update
those directly (bf16 has 8 bits of mantissa, so small updates vanish). Like Megatron's
Float16OptimizerWithFloat16Params, we keep an fp32 "main" copy of every parameter and
accumulate gradients in fp32: each parameter's bf16 gradient is added to an fp32
`main_grad` as soon as autograd has produced it (a post-accumulate-grad hook), so
gradient accumulation over micro-batches never rounds in bf16. In fp32 the model
parameters are the main parameters.

`step()` reduces gradients (data parallel, supplied by the caller), unscales them when a
loss scaler is in use (--fp16, --loss-scale: grad_scaler.py) and skips the update when a
rank overflowed, computes the global gradient norm, skips the update when it is not
finite, clips, runs the inner torch optimizer and copies the result back to the model
parameters.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from megamoe.config import OptimizerConfig
from megamoe.training.nonfinite import NonFiniteCheck, Riders, read_grad_norm
from megamoe.training.optim.common import (
    bf16_main_grads,
    build_inner_optimizer,
    fp32_accumulate_hook,
    main_grad_dtype,
    param_groups,
    restored_step,
    set_step_count,
    step_count,
)
from megamoe.training.optim.grad_scaler import build_grad_scaler, unscale_and_check
from megamoe.training.optim.grads import (
    clip_coefficient,
    local_grad_norm,
    model_parallel_sum,
    squares,
    zero_counts,
)
from megamoe.training.optim.overlap import (
    GradReduceOverlap,
    OverlapOptions,
    allreduce_buckets,
    backward_order,
)
from megamoe.training.optim.state_precision import restore_states, saved_states

ReduceGradsFn = Callable[[list[torch.Tensor]], None]
GradNormFn = Callable[[list[torch.Tensor]], torch.Tensor]


class MixedPrecisionOptimizer:
    """Adam/SGD over fp32 main parameters with fp32 gradient accumulation."""

    def __init__(self, model: torch.nn.Module, config: OptimizerConfig,
                 reduce_grads_fn: Optional[ReduceGradsFn] = None,
                 grad_norm_fn: Optional[GradNormFn] = None, *,
                 overlap: Optional[OverlapOptions] = None, dp_group=None,
                 edp_group=None, use_distributed_optimizer: bool = False) -> None:
        """With `overlap` (--overlap-grad-reduce) the fp32 main gradients are views of
        buckets all-reduced over `dp_group` / `edp_group` from the backward (overlap.py);
        `reduce_grads_fn` then does only what follows the data-parallel reduction.
        `use_distributed_optimizer`: the flag (on one data-parallel rank this optimizer
        runs), which gives a constant --loss-scale to an fp32 model too, as Megatron."""
        self.config = config
        self.grad_scaler = build_grad_scaler(config, use_distributed_optimizer)
        self.reduce_grads_fn = reduce_grads_fn
        self.grad_norm_fn = grad_norm_fn or local_grad_norm
        # (tp, pp, ep, etp): how params norm and zero counts count each parameter once
        # (build_optimizer sets them from the mesh; None: this process holds every one).
        self.model_parallel_groups: tuple = (None, None, None, None)
        # One rank and nothing to reduce (build_optimizer sets it from the mesh): the NaN
        # check reads the step's norm instead of a norm pass of its own.
        self.single_rank = False
        # Other ranks exist (build_optimizer sets it from the mesh): the loss scaler's
        # overflow flag is agreed over all of them.
        self.agree_found_inf = False
        groups = param_groups(model, config)
        self.model_params: list[torch.nn.Parameter] = [p for g in groups for p in g["params"]]
        self.separate_main = any(p.dtype != torch.float32 for p in self.model_params)
        self.grad_sync: Optional[GradReduceOverlap] = None
        # The main gradients when they are not the parameters' own .grad: bucket views
        # (overlap) or accumulation buffers (bf16 model), fp32 or --main-grads-dtype bf16.
        self.grad_views: Optional[list[torch.Tensor]] = None
        grad_dtypes = [main_grad_dtype(p, bf16_main_grads(config)) for p in self.model_params]
        if overlap is not None:
            self.grad_views, buckets = allreduce_buckets(
                self.model_params, backward_order(model, self.model_params),
                overlap.bucket_size, dp_group, edp_group, grad_dtypes)
        elif self.separate_main:
            self.grad_views = [torch.zeros_like(p, dtype=dtype)
                               for p, dtype in zip(self.model_params, grad_dtypes)]
        if self.grad_views is not None:
            for p, view in zip(self.model_params, self.grad_views):
                p.register_post_accumulate_grad_hook(fp32_accumulate_hook(view))
        if self.separate_main:
            main_groups = []
            self.main_params: list[torch.Tensor] = []
            for g in groups:
                mains = [p.detach().float().clone().requires_grad_(True) for p in g["params"]]
                self.main_params += mains
                main_groups.append({**g, "params": mains})
            groups = main_groups
            for main, view in zip(self.main_params, self.grad_views):
                if view.dtype == main.dtype:  # (a bf16 one is upcast at each update)
                    main.grad = view
        else:
            self.main_params = self.model_params
        if overlap is not None:  # its hooks run after the accumulating ones
            self.grad_sync = GradReduceOverlap(buckets, overlap.check_nan,
                                               self.grad_views[0].device)
        self.optimizer = build_inner_optimizer(groups, config)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        """The loss scale the next backward uses (1 without a scaler: bf16 and fp32)."""
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        if self.grad_sync is not None:
            for bucket in self.grad_sync.buckets:
                bucket.flat_grad.zero_()
            self.grad_sync.reset()
        elif self.grad_views is not None:
            torch._foreach_zero_(self.grad_views)
        else:
            for p in self.main_params:
                p.grad = None

    def main_grads(self) -> list[torch.Tensor]:
        """Gradients to reduce and clip; parameters that got no gradient get zeros. With
        overlap or a bf16 model: the accumulation views (clip_and_update hands them to the
        inner optimizer as the mains' .grad)."""
        if self.grad_views is not None:
            return list(self.grad_views)
        grads = []
        for p in self.main_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads

    @torch.no_grad()
    def step(self, check: Optional[NonFiniteCheck] = None, count_zeros: bool = False,
             riders: Optional[Riders] = None
             ) -> tuple[bool, Optional[float], Optional[torch.Tensor]]:
        """Returns (updated, grad norm before clipping, number of zero gradient elements
        when `count_zeros` (--log-num-zeros-in-grad), else None). Reading the norm is the
        step's one device->host synchronisation (the skip decision and the log need it;
        the loss scaler's overflow flag is read with it); clipping uses it on the device.
        With a `check` (--check-for-nan-in-loss-and-grad) the local gradients are checked
        before the reduction, and a NaN/Inf on any rank raises NonFiniteError before the
        update. An overflow under loss scaling skips the step on every rank (the scaler
        backs off); its norm and zero count are not computed (None), as Megatron. `riders`:
        values read with the norm (nonfinite.Riders)."""
        grads = self.main_grads()
        if self.grad_sync is not None:  # waits for the buckets the backward launched
            bad = self.grad_sync.finish()
            if check is not None:
                check.see_local_verdict(bad)
        elif check is not None and not self.single_rank:
            check.see_grads(grads)
        if self.reduce_grads_fn is not None:
            self.reduce_grads_fn(grads)
        found_inf = None
        if self.grad_scaler is not None:  # after the reduction of the scaled gradients
            found_inf = unscale_and_check(grads, self.grad_scaler, _device(grads),
                                          self.agree_found_inf)
        norm = self.grad_norm_fn(grads)
        if check is not None and self.single_rank and self.grad_sync is None:
            # One rank: no reduction changes the gradients, so the norm of the step is the
            # local norm the check needs (Megatron checks a norm too): one pass, not two.
            check.see_local_verdict(~torch.isfinite(norm))
        grad_norm, overflow = read_grad_norm(norm, check, found_inf, riders)
        if self.grad_scaler is not None:
            self.grad_scaler.update(overflow)
            if overflow:
                return False, None, None
        zeros = self.count_zeros(grads) if count_zeros else None
        if not math.isfinite(grad_norm):
            return False, grad_norm, zeros
        self.clip_and_update(grads, norm)
        return True, grad_norm, zeros

    def count_zeros(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Zero elements of the reduced gradients `grads` (aligned with the parameters),
        each element counted once across tp / pp / ep (Megatron's count_zeros_fp32): a
        0-d int64 device tensor, read with the other logged values (training/host_read)."""
        return model_parallel_sum(zero_counts(grads), self.model_params,
                                  *self.model_parallel_groups, dtype=torch.int64)

    def wait_param_gather(self) -> None:
        """The model parameters are this step's (they always are: no gather to wait)."""

    @torch.no_grad()
    def params_norm(self) -> torch.Tensor:
        """L2 norm of all parameters (the fp32 main copies, as Megatron's
        calc_params_l2_norm), each counted once across tp / pp / ep: a 0-d device tensor,
        read with the other logged values (training/host_read)."""
        return model_parallel_sum(squares(self.main_params), self.model_params,
                                  *self.model_parallel_groups).sqrt()

    @torch.no_grad()
    def clip_and_update(self, grads: list[torch.Tensor], norm: torch.Tensor) -> None:
        """Scale the gradients to --clip-grad (a device-side coefficient), update the main
        parameters, copy them into the model's."""
        if self.config.clip_grad > 0:
            torch._foreach_mul_(grads, clip_coefficient(norm, self.config.clip_grad))
        upcast = []  # (bf16 main grads: an fp32 copy for the update, freed after it)
        if self.grad_views is not None:
            for main, grad in zip(self.main_params, grads):
                main.grad = grad if grad.dtype == main.dtype else grad.float()
                upcast += [main] if grad.dtype != main.dtype else []
        self.optimizer.step()
        for main in upcast:
            main.grad = None
        if self.separate_main:
            torch._foreach_copy_(self.model_params, self.main_params)

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.separate_main:
            state["main_params"] = [m.detach().clone() for m in self.main_params]
        if self.grad_scaler is not None:  # Megatron's key; plain numbers: a snapshot
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_grad_scaler_state(self, state: Optional[dict]) -> None:
        """A checkpoint's loss-scaler state (None: an older checkpoint, or a run without
        a scaler: this run's scaler keeps its initial state, as Megatron's)."""
        if self.grad_scaler is not None and state is not None:
            self.grad_scaler.load_state_dict(state)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_grad_scaler_state(state.get("grad_scaler"))
        if self.separate_main and "main_params" in state:
            for p, main, saved in zip(self.model_params, self.main_params,
                                      state["main_params"]):
                main.copy_(saved)
                p.copy_(main)

    def param_states(self) -> tuple[list[Optional[dict[str, torch.Tensor]]],
                                    Optional[torch.Tensor], list[str]]:
        """Per model parameter (aligned with `model_params`): the inner optimizer's tensor
        states (exp_avg, exp_avg_sq / momentum_buffer) and, when it is a separate fp32 copy,
        "main"; plus the step count (None before the first step) and the state names. What
        layout-free (torch_dist) checkpoints save (the distributed optimizer gives None for
        the parameters another rank saves)."""
        out, step = [], None
        for main in self.main_params:
            st = saved_states(self.optimizer, main)
            d = {k: v for k, v in st.items()
                 if isinstance(v, torch.Tensor) and v.shape == main.shape}
            if self.separate_main:
                d["main"] = main.detach()
            step = step_count(self.optimizer, st) if st else step
            out.append(d)
        return out, step, sorted({k for st in out for k in st})

    def saves_param(self, index: int) -> bool:
        """Every rank offers its parameters to a checkpoint (DCP writes replicas once)."""
        return True

    def loads_param(self, index: int) -> bool:
        return True

    @torch.no_grad()
    def load_param_states(self, states: list[dict[str, torch.Tensor]],
                          step: Optional[torch.Tensor]) -> None:
        """Inverse of `param_states` ("main" optional: else taken from the parameter). An
        fp32 model takes a saved "main" as its parameter: the exact value where the saving
        run held its weights rounded (bf16, or FP8 under --fp8-param-gather)."""
        for p, main, st in zip(self.model_params, self.main_params, states):
            if self.separate_main:
                main.copy_(st["main"] if "main" in st else p.float())
                p.copy_(main)
            elif "main" in st:
                p.copy_(st["main"])
            tensors = {k: v.detach().clone() for k, v in st.items() if k != "main"}
            if tensors:
                set_step_count(self.optimizer, step)
                restore_states(self.optimizer, main,
                               restored_step(self.optimizer, step, main) | tensors)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """After model weights change outside the optimizer (checkpoint load without
        optimizer state), refresh the fp32 main copies from them."""
        if self.separate_main:
            for p, main in zip(self.model_params, self.main_params):
                main.copy_(p.float())


def _device(grads: list[torch.Tensor]) -> torch.device:
    return grads[0].device if grads else torch.device("cpu")
