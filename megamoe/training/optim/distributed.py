"""Distributed optimizer (--use-distributed-optimizer): fp32 main parameters and Adam states
sharded across data-parallel ranks (ZeRO-1, Megatron-Core's DistributedOptimizer).

Dense parameters are sharded across the dp group, routed-expert parameters
(`param.expert_parallel`) across their expert-data-parallel group: per shard group and
dtype one `FlatShards` (flat_shards.py) holds the parameters in a flat model-dtype buffer
and their gradients in a flat fp32 buffer the backward accumulates into; rank r owns the
r-th contiguous slice. Each parameter's piece of that slice has an fp32 main tensor (a view
of the main shard) in the parameter's weight-decay group, so AdamW, which is elementwise,
computes exactly what the unsharded optimizer computes for those elements.

step(): TP / embedding partial gradients are summed first in the grad buffer (as
data_parallel.reduce_gradients does), then each grad buffer is reduce-scattered in place
over its group and its shard divided by DP, so a rank holds only its slice of the
global-batch-mean gradient. The gradient norm sums the slices' squares over the shard
groups (then TP for TP-sharded parameters, EP for experts, PP for stages: every parameter
counted once), clipping scales the slices in place, AdamW updates the main slices through
views of them, and an in-place all-gather of the model-dtype param buffer writes the
updated parameters back into every rank's model. No full-size copy of the gradients or
parameters is made (planning/memory.py counts what remains).

Checkpoints (torch_dist): each parameter is saved by one rank of its shard group, the one
holding its first element (`saves_param`): its states are views of that rank's shard, or,
for a parameter crossing the shard's end, assembled there from the other holders' pieces
(`param_states`), one parameter at a time.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megamoe.config import OptimizerConfig
from megamoe.model.fp8.params import primary
from megamoe.parallel.comm import group_size
from megamoe.training.nonfinite import NonFiniteCheck, Riders, read_grad_norm
from megamoe.training.optim.common import (
    bf16_main_grads,
    build_inner_optimizer,
    param_groups,
    restored_step,
    set_step_count,
    step_count,
)
from megamoe.training.optim.flat_shards import FlatShards, Piece
from megamoe.training.optim.fp8_shards import Fp8FlatShards
from megamoe.training.optim.grad_scaler import build_grad_scaler, unscale_and_check
from megamoe.training.optim.grads import clip_coefficient, square_sum, sum_marked
from megamoe.training.optim.overlap import (
    Bucket,
    GradReduceOverlap,
    OverlapOptions,
    ParamGatherOverlap,
    backward_order,
    split_buckets,
)
from megamoe.training.optim.state_precision import restore_states, saved_states

Group = Optional[dist.ProcessGroup]
ParamStates = list[Optional[dict[str, torch.Tensor]]]


def _shard_groups(params: list[torch.nn.Parameter], dp_group: Group, edp_group: Group,
                  order: Optional[list[int]] = None, bucket_size: Optional[int] = None,
                  bf16_grads: bool = False) -> list[FlatShards]:
    """One FlatShards per (dense | expert, dtype), in order of first appearance. With a
    `bucket_size` (--overlap-grad-reduce) one per bucket of each, the parameters in `order`
    (the backward's) and each bucket sharded on its own, as Megatron's: a tied embedding
    alone in its bucket, so the first and last pipeline stage shard it the same way and
    its reduce-scattered shards can be summed over the embedding group. `bf16_grads`
    (--main-grads-dtype bf16): bf16 parameters' grad buffers are bf16."""
    split: dict[tuple[bool, torch.dtype, bool], list[tuple[int, torch.nn.Parameter]]] = {}
    for i in range(len(params)) if order is None else order:
        p = params[i]
        key = (bool(getattr(p, "expert_parallel", False)), p.dtype, primary(p) is not None)
        split.setdefault(key, []).append((i, p))
    def grad_dtype(dtype: torch.dtype) -> torch.dtype:
        return dtype if bf16_grads and dtype == torch.bfloat16 else torch.float32

    def shards(members, expert: bool, dtype: torch.dtype, fp8: bool) -> FlatShards:
        kind = Fp8FlatShards if fp8 else FlatShards  # --fp8-param-gather: FP8 bytes
        return kind(members, edp_group if expert else dp_group, expert, grad_dtype(dtype))

    if bucket_size is None:
        return [shards(members, *key) for key, members in split.items()]
    return [shards(part, *key) for key, members in split.items()
            for part in split_buckets(members, lambda m: m[1].numel(), bucket_size,
                                      lambda m: getattr(m[1], "shared_embedding", False))]


class DistributedOptimizer:
    """Same interface as MixedPrecisionOptimizer; states live on 1 / DP of the ranks each."""

    def __init__(self, model: torch.nn.Module, config: OptimizerConfig, *, tp_group: Group,
                 dp_group: Group, pp_group: Group = None, embd_group: Group = None,
                 ep_group: Group = None, edp_group: Group = None,
                 etp_group: Group = None, overlap: Optional[OverlapOptions] = None) -> None:
        """`overlap` (--overlap-grad-reduce): one FlatShards per bucket, reduce-scattered
        from the backward; with `overlap.param_gather` the all-gathers overlap the next
        forward (overlap.py)."""
        self.config = config
        self.tp_group, self.dp_group, self.pp_group = tp_group, dp_group, pp_group
        self.embd_group, self.ep_group, self.edp_group = embd_group, ep_group, edp_group
        self.etp_group = etp_group
        # --fp16 / --loss-scale; the overflow flag is agreed over every rank (Megatron's
        # distributed optimizer reduces its gradient statistics over the whole world)
        self.grad_scaler = build_grad_scaler(config, distributed=True)
        self.agree_found_inf = dist.is_initialized() and dist.get_world_size() > 1
        groups = param_groups(model, config)
        self.model_params: list[torch.nn.Parameter] = [p for g in groups for p in g["params"]]
        self.buffers = _shard_groups(
            self.model_params, dp_group, edp_group,
            None if overlap is None else backward_order(model, self.model_params),
            None if overlap is None else overlap.bucket_size, bf16_main_grads(config))
        # (FP8 primary weights keep an fp32 main whatever the model dtype: it is saved)
        self.separate_main = any(buf.separate_main for buf in self.buffers)
        for buf in self.buffers:  # FP8 primary weights: quantised before the first forward
            if isinstance(buf, Fp8FlatShards):
                buf.all_gather_params()
        self.grad_sync, self.param_gather = self._overlap(model, overlap)
        self.grad_buffers = [buf.grad_buffer for buf in self.buffers]
        self._where = {i: (buf, k) for buf in self.buffers
                       for k, (i, _) in enumerate(buf.params)}
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        main_groups = [{**g, "params": []} for g in groups]
        for buf in self.buffers:
            for piece in buf.pieces:
                main_groups[group_of[id(piece.param)]]["params"].append(piece.main)
        main_groups = [g for g in main_groups if g["params"]]
        if not main_groups:  # a rank whose shards are empty still steps (no-op)
            main_groups = [{"params": [torch.zeros(0, device="cpu")]}]  # nothing to place
        self.optimizer = build_inner_optimizer(main_groups, config)

    def _overlap(self, model: torch.nn.Module, overlap: Optional[OverlapOptions]
                 ) -> tuple[Optional[GradReduceOverlap], Optional[ParamGatherOverlap]]:
        if overlap is None:
            return None, None
        dp_size = group_size(self.dp_group)
        buckets = [Bucket([p for _, p in buf.params], buf.grad_buffer, buf.start_reduce_scatter,
                          lambda shard=buf.grad_shard: shard.div_(dp_size))
                   for buf in self.buffers]
        device = self.buffers[0].grad_buffer.device
        grads = GradReduceOverlap(buckets, overlap.check_nan, device)
        params = None
        if overlap.param_gather:
            params = ParamGatherOverlap(model, [b.params for b in buckets],
                                        [buf.start_all_gather_params for buf in self.buffers])
        return grads, params

    def wait_param_gather(self) -> None:
        """Wait for the overlapped all-gathers of the last update (--overlap-param-gather):
        before anything but the forward's pre-hooks reads or writes the parameters."""
        if self.param_gather is not None:
            self.param_gather.wait()

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _pieces(self) -> list[Piece]:
        return [piece for buf in self.buffers for piece in buf.pieces]

    def get_loss_scale(self) -> float:
        """The loss scale the next backward uses (1 without a scaler)."""
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        for buf in self.buffers:
            buf.zero_grad()
        if self.grad_sync is not None:
            self.grad_sync.reset()

    def _grad_views(self) -> list[torch.Tensor]:
        """Each model parameter's gradient: its view of the grad buffer."""
        views: list[Optional[torch.Tensor]] = [None] * len(self.model_params)
        for buf in self.buffers:
            for (i, p), off in zip(buf.params, buf.offsets):
                views[i] = buf.grad_buffer[off:off + p.numel()].view(p.shape)
        return views

    def _grad_norm(self) -> torch.Tensor:
        """The global gradient norm (a 0-d device tensor), every parameter once."""
        return self._sharded_sum(lambda piece: square_sum(piece.grad)).sqrt()

    def _sharded_sum(self, value: Callable[[Piece], torch.Tensor],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Sum of `value(piece)` over every piece of every rank, each parameter once:
        [tp-sharded, tp-replicated] dense sums over dp (then the first over tp), expert
        sums [etp-replicated, etp-sharded] over edp, the second over etp, both over ep,
        everything over pp. A 0-d device tensor of `dtype`."""
        device = self.buffers[0].grad_buffer.device if self.buffers else "cpu"
        dense = torch.zeros(2, dtype=dtype, device=device)
        expert = torch.zeros(2, dtype=dtype, device=device)
        for buf in self.buffers:
            sums = expert if buf.expert else dense
            attr = "etp_sharded" if buf.expert else "tensor_model_parallel"
            for piece in buf.pieces:
                if not getattr(piece.param, "shared_copy", False):
                    sums[0 if getattr(piece.param, attr, False) else 1] += value(piece)
        for t, group in ((dense, self.dp_group), (expert, self.edp_group)):
            if group is not None:
                dist.all_reduce(t, group=group)
        if self.tp_group is not None:
            dist.all_reduce(dense[:1], group=self.tp_group)
        if self.etp_group is not None:
            dist.all_reduce(expert[:1], group=self.etp_group)
        if self.ep_group is not None:
            dist.all_reduce(expert, group=self.ep_group)
        total = (dense.sum() + expert.sum()).reshape(1)
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
        return total.reshape(())

    def count_zeros(self) -> torch.Tensor:
        """Zero elements of the reduced gradient (this rank's slices, summed over the shard
        groups: each element once; Megatron's count_zeros_fp32): a 0-d int64 device
        tensor, read with the other logged values (training/host_read)."""
        return self._sharded_sum(
            lambda piece: piece.grad.numel() - torch.count_nonzero(piece.grad), torch.int64)

    @torch.no_grad()
    def params_norm(self) -> torch.Tensor:
        """L2 norm of all parameters: the fp32 main slices, summed over the shard groups
        (Megatron's calc_params_l2_norm of sharded main params); a 0-d device tensor."""
        self.wait_param_gather()
        return self._sharded_sum(
            lambda piece: torch.linalg.vector_norm(piece.main, dtype=torch.float32).square()
        ).sqrt()

    @torch.no_grad()
    def step(self, check: Optional[NonFiniteCheck] = None, count_zeros: bool = False,
             riders: Optional[Riders] = None
             ) -> tuple[bool, Optional[float], Optional[torch.Tensor]]:
        """As MixedPrecisionOptimizer.step: reading the norm is the one host sync (with the
        loss scaler's overflow flag: this rank unscales its slices, the flag is agreed over
        every rank); a `check` sees the whole local grad buffers before they are reduced
        (with overlap, each bucket's before its collective started); `riders` are read
        with the norm."""
        self.wait_param_gather()
        if check is not None and self.grad_sync is None:
            check.see_grads(self.grad_buffers)
        self.reduce(check)
        found_inf = None
        if self.grad_scaler is not None:
            device = self.buffers[0].grad_buffer.device if self.buffers else "cpu"
            found_inf = unscale_and_check([piece.grad for piece in self._pieces()],
                                          self.grad_scaler, device, self.agree_found_inf)
        norm = self._grad_norm()
        grad_norm, overflow = read_grad_norm(norm, check, found_inf, riders)
        if self.grad_scaler is not None:
            self.grad_scaler.update(overflow)
            if overflow:  # skipped on every rank; the model keeps its parameters
                return False, None, None
        zeros = self.count_zeros() if count_zeros else None
        if not math.isfinite(grad_norm):
            return False, grad_norm, zeros
        self.clip_and_update(norm)
        return True, grad_norm, zeros

    @torch.no_grad()
    def reduce_and_norm(self, check: Optional[NonFiniteCheck] = None) -> torch.Tensor:
        """`reduce`, then the global norm (a device tensor; of the gradients as they are:
        still scaled under loss scaling)."""
        self.reduce(check)
        return self._grad_norm()

    @torch.no_grad()
    def reduce(self, check: Optional[NonFiniteCheck] = None) -> None:
        """Sum the TP / embedding partial gradients and reduce-scatter every grad buffer
        (this rank keeps its slice of the mean). With overlap the reduce-scatters ran from
        the backward: wait for them, then sum the partial gradients' slices (the same
        slices on the TP peers, which lay their buffers out alike, and on the two
        embedding stages, where the embedding is a bucket of its own): sums commute with
        the data-parallel one."""
        if self.grad_sync is not None:
            bad = self.grad_sync.finish()
            if check is not None:
                check.see_local_verdict(bad)
            pieces = [piece for buf in self.buffers if not buf.expert for piece in buf.pieces]
            grads, params = [pc.grad for pc in pieces], [pc.param for pc in pieces]
            sum_marked(grads, params, "sequence_parallel", self.tp_group, 1 << 62)
            sum_marked(grads, params, "shared_embedding", self.embd_group, 1 << 62)
            return
        grads = self._grad_views()
        sum_marked(grads, self.model_params, "sequence_parallel", self.tp_group, 1 << 62)
        sum_marked(grads, self.model_params, "shared_embedding", self.embd_group, 1 << 62)
        dp_size = group_size(self.dp_group)
        for buf in self.buffers:
            buf.reduce_scatter(dp_size)

    @torch.no_grad()
    def clip_and_update(self, norm: torch.Tensor) -> None:
        """Clip the slices (a device-side coefficient), update the main slices, all-gather
        the updated parameters into every rank's model."""
        pieces = self._pieces()
        if self.config.clip_grad > 0 and pieces:  # a device-side coefficient
            torch._foreach_mul_([piece.grad for piece in pieces],
                                clip_coefficient(norm, self.config.clip_grad))
        for piece in pieces:  # (bf16 main grads: an fp32 copy, as TE's kernel reads them)
            piece.main.grad = piece.grad if piece.grad.dtype == torch.float32 \
                else piece.grad.float()
        self.optimizer.step()
        for piece in pieces:
            if piece.grad.dtype != torch.float32:
                piece.main.grad = None  # (the copy: freed)
        if self.param_gather is not None:  # waited for by the next forward's pre-hooks
            self.param_gather.launch()
            return
        for buf in self.buffers:
            buf.all_gather_params()

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer beyond the parameters and the grad
        buffers: fp32 main slices (bf16 models only) + optimizer states."""
        n = sum(buf.main_shard.numel() * 4 for buf in self.buffers if buf.separate_main)
        for state in self.optimizer.state.values():
            n += sum(t.numel() * t.element_size() for t in state.values()
                     if isinstance(t, torch.Tensor) and t.numel() > 1)
        return n

    def state_dict(self) -> dict:
        """This rank's shard only (checkpoints with DP > 1 are rejected by the flags)."""
        self.wait_param_gather()
        state = {"optimizer": self.optimizer.state_dict(),
                 "main_params": [piece.main.detach().clone() for piece in self._pieces()]}
        if self.grad_scaler is not None:  # the same on every rank
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_grad_scaler_state(self, state: Optional[dict]) -> None:
        """As MixedPrecisionOptimizer.load_grad_scaler_state."""
        if self.grad_scaler is not None and state is not None:
            self.grad_scaler.load_state_dict(state)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.wait_param_gather()
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_grad_scaler_state(state.get("grad_scaler"))
        for piece, saved in zip(self._pieces(), state["main_params"]):
            piece.main.copy_(saved)
        for buf in self.buffers:
            buf.all_gather_params()

    def _state_names(self) -> list[str]:
        if self.config.optimizer == "adam":
            return ["exp_avg", "exp_avg_sq"]
        return ["momentum_buffer"] if self.config.sgd_momentum else []

    def _agreed_step(self) -> tuple[bool, Optional[torch.Tensor]]:
        """(stepped, step count) agreed over dp and edp (a rank may own no piece)."""
        local = [st for st in self.optimizer.state.values() if st]
        device = self.buffers[0].grad_buffer.device if self.buffers else "cpu"
        count = step_count(self.optimizer, local[0]) if local else None
        t = torch.tensor([1.0 if local else 0.0, -1.0 if count is None else float(count)],
                         device=device)
        for group in (self.dp_group, self.edp_group):
            if group is not None:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        # The step count is a CPU scalar, as AdamW keeps it (capturable=False).
        step = torch.tensor(float(t[1]), dtype=torch.float32, device="cpu") if t[1] >= 0 \
            else None
        return bool(t[0]), step

    def saves_param(self, index: int) -> bool:
        """Whether this rank saves model_params[index] (weights and states) in a torch_dist
        checkpoint: one rank of each shard group does, so the save is split ~1 / DP."""
        buf, k = self._where[index]
        return buf.owner(k) == buf.rank

    def loads_param(self, index: int) -> bool:
        """Whether this rank needs model_params[index]'s states at load (holds a piece)."""
        buf, k = self._where[index]
        return k in buf.piece_at

    @torch.no_grad()
    def param_states(self) -> tuple[ParamStates, Optional[torch.Tensor], list[str]]:
        """As MixedPrecisionOptimizer.param_states, for the parameters this rank saves
        (None for the others): whole per-parameter tensors, views of this rank's shard
        where the parameter lies in it, else assembled here from the other holders' pieces
        (collective over the shard groups)."""
        self.wait_param_gather()
        stepped, step = self._agreed_step()
        names = (["main"] if self.separate_main else []) + (self._state_names() if stepped
                                                               else [])
        out: ParamStates = [None] * len(self.model_params)
        for buf in self.buffers:
            for k, (i, p) in enumerate(buf.params):
                piece = buf.piece_at.get(k)
                saved = {} if piece is None else saved_states(self.optimizer, piece.main)
                local = [] if piece is None else [
                    piece.main if name == "main" else saved[name] for name in names]
                whole = buf.gather_to_owner(k, local)
                if buf.owner(k) == buf.rank:
                    out[i] = {name: t.view(p.shape) for name, t in zip(names, whole or [])}
        return out, step, names

    @torch.no_grad()
    def load_param_states(self, states: list[dict[str, torch.Tensor]],
                          step: Optional[torch.Tensor]) -> None:
        """Whole per-parameter states (any dp layout they were saved from; only those of
        the parameters this rank holds a piece of are read) -> this rank's slices; "main"
        optional (else the loaded parameter)."""
        self.wait_param_gather()
        for buf, piece in ((b, pc) for b in self.buffers for pc in b.pieces):
            st = states[piece.index]
            if "main" in st:
                piece.main.copy_(st["main"].reshape(-1)[piece.start:piece.end])
            elif buf.separate_main:  # (else the main is the parameter)
                piece.main.copy_(buf.piece_values(piece))
            tensors = {k: v.reshape(-1)[piece.start:piece.end].clone()
                       for k, v in st.items() if k != "main"}
            if tensors:
                set_step_count(self.optimizer, step)
                restore_states(self.optimizer, piece.main,
                               restored_step(self.optimizer, step, piece.main) | tensors)
        for buf in self.buffers:
            buf.all_gather_params()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        self.wait_param_gather()
        for buf in self.buffers:
            buf.main_from_params()
