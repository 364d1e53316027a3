"""Distributed optimizer (--use-distributed-optimizer): fp32 main parameters and Adam states
sharded across data-parallel ranks (ZeRO-1, Megatron-Core's DistributedOptimizer).

Dense parameters are sharded across the dp group, routed-expert parameters
(`param.expert_parallel`) across their expert-data-parallel group. Per shard group the
parameters are laid out back to back in one flat fp32 range, padded to a multiple of the
group size; rank r owns the r-th contiguous slice. Each parameter's piece of that slice is
an fp32 main tensor of its own, in the parameter's weight-decay group, so AdamW, which is
elementwise, computes exactly what the unsharded optimizer computes for those elements.

step(): TP / embedding partial gradients are summed first (as data_parallel.reduce_gradients
does), then each flat gradient is reduce-scattered over its group (gloo implements
reduce-scatter in this torch; checked by the tests) and divided by DP, so a rank receives only its
slice of the global-batch-mean gradient. The gradient norm sums the slices' squares over the
shard groups (then TP for TP-sharded parameters, EP for experts, PP for stages: every
parameter counted once), clipping scales the slices, AdamW updates the main slices, and
an all-gather writes the updated parameters back into every rank's model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megamoe.config import OptimizerConfig
from megamoe.parallel.comm import group_rank, group_size
from megamoe.training.optim.common import build_inner_optimizer, fp32_accumulate_hook, param_groups
from megamoe.training.optim.grads import sum_marked

Group = Optional[dist.ProcessGroup]
# torch >= 2.10 names (the *_tensor spellings are deprecated aliases).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class _Piece:
    """The part of `param` (flat elements [start, end)) inside this rank's shard."""

    param: torch.nn.Parameter
    index: int  # position in the optimizer's model_params
    start: int
    end: int
    shard_offset: int  # where the piece starts inside the rank's shard
    main: torch.Tensor  # fp32 main copy of the piece (1-D), what AdamW updates


class _ShardedBuffer:
    """Flat layout of a set of parameters sharded over one group."""

    def __init__(self, params: list[tuple[int, torch.nn.Parameter]], group: Group) -> None:
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)
        self.params = params
        self.offsets = []
        total = 0
        for _, p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = -(-total // self.size) * self.size  # padded to a multiple of the size
        self.shard_numel = self.numel // self.size
        lo = self.rank * self.shard_numel
        hi = lo + self.shard_numel
        self.pieces: list[_Piece] = []
        for (index, p), off in zip(params, self.offsets):
            start, end = max(lo, off) - off, min(hi, off + p.numel()) - off
            if start < end:
                main = p.detach().reshape(-1)[start:end].float().clone()
                self.pieces.append(_Piece(p, index, start, end, off + start - lo, main))

    def flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Concatenate (fp32) tensors aligned with self.params, zero-padded to numel."""
        out = torch.zeros(self.numel, dtype=torch.float32)
        for t, off in zip(tensors, self.offsets):
            out[off:off + t.numel()] = t.reshape(-1)
        return out

    def reduce_scatter(self, grads: list[torch.Tensor], divisor: int) -> torch.Tensor:
        """This rank's slice of sum-over-group(grads) / divisor."""
        full = self.flat(grads)
        if self.size == 1:
            shard = full
        else:
            shard = torch.empty(self.shard_numel, dtype=torch.float32)
            _reduce_scatter(shard, full, group=self.group)
        return shard.div_(divisor)

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Write every rank's updated main slices into the model parameters."""
        shard = torch.zeros(self.shard_numel, dtype=torch.float32)
        for piece in self.pieces:
            shard[piece.shard_offset:piece.shard_offset + piece.main.numel()] = piece.main
        if self.size == 1:
            full = shard
        else:
            full = torch.empty(self.numel, dtype=torch.float32)
            _all_gather(full, shard, group=self.group)
        for (_, p), off in zip(self.params, self.offsets):
            p.copy_(full[off:off + p.numel()].view_as(p))


class DistributedOptimizer:
    """Same interface as MixedPrecisionOptimizer; states live on 1 / DP of the ranks each."""

    def __init__(self, model: torch.nn.Module, config: OptimizerConfig, *, tp_group: Group,
                 dp_group: Group, pp_group: Group = None, embd_group: Group = None,
                 ep_group: Group = None, edp_group: Group = None,
                 etp_group: Group = None) -> None:
        self.config = config
        self.tp_group, self.dp_group, self.pp_group = tp_group, dp_group, pp_group
        self.embd_group, self.ep_group, self.edp_group = embd_group, ep_group, edp_group
        self.etp_group = etp_group
        groups = param_groups(model, config.weight_decay)
        self.model_params: list[torch.nn.Parameter] = [p for g in groups for p in g["params"]]
        self.separate_grads = any(p.dtype != torch.float32 for p in self.model_params)
        if self.separate_grads:  # bf16 model: accumulate gradients in fp32 (see optimizer.py)
            self.grad_buffers = [torch.zeros(p.shape, dtype=torch.float32)
                                 for p in self.model_params]
            for p, buf in zip(self.model_params, self.grad_buffers):
                p.register_post_accumulate_grad_hook(fp32_accumulate_hook(buf))
        indexed = list(enumerate(self.model_params))
        self.buffers = [
            _ShardedBuffer([(i, p) for i, p in indexed
                            if not getattr(p, "expert_parallel", False)], dp_group),
            _ShardedBuffer([(i, p) for i, p in indexed
                            if getattr(p, "expert_parallel", False)], edp_group),
        ]
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        main_groups = [{**g, "params": []} for g in groups]
        for buf in self.buffers:
            for piece in buf.pieces:
                piece.main.requires_grad_(True)
                main_groups[group_of[id(piece.param)]]["params"].append(piece.main)
        main_groups = [g for g in main_groups if g["params"]]
        if not main_groups:  # a rank whose shards are empty still steps (no-op)
            main_groups = [{"params": [torch.zeros(0, requires_grad=True)]}]
        self.optimizer = build_inner_optimizer(main_groups, config)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        return 1.0

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        if self.separate_grads:
            for buf in self.grad_buffers:
                buf.zero_()

    def _full_grads(self) -> list[torch.Tensor]:
        if self.separate_grads:
            return self.grad_buffers
        return [p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                for p in self.model_params]

    def _grad_norm(self, shards: list[torch.Tensor]) -> float:
        """Every parameter once: [tp-sharded, tp-replicated] dense squares summed over dp
        (then the first over tp), expert squares [etp-replicated, etp-sharded] over edp,
        the second over etp, both over ep, everything over pp."""
        dense = torch.zeros(2, dtype=torch.float32)
        expert = torch.zeros(2, dtype=torch.float32)
        for buf, shard, sq in ((self.buffers[0], shards[0], dense),
                               (self.buffers[1], shards[1], expert)):
            for piece in buf.pieces:
                if getattr(piece.param, "shared_copy", False):
                    continue
                g = shard[piece.shard_offset:piece.shard_offset + piece.main.numel()]
                attr = "tensor_model_parallel" if sq is dense else "etp_sharded"
                i = 0 if getattr(piece.param, attr, False) else 1
                sq[i] += g.square().sum()
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
        return float(total.sqrt())

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        grads = self._full_grads()
        sum_marked(grads, self.model_params, "sequence_parallel", self.tp_group, 1 << 62)
        sum_marked(grads, self.model_params, "shared_embedding", self.embd_group, 1 << 62)
        dp_size = group_size(self.dp_group)
        shards = []
        for buf in self.buffers:
            shards.append(buf.reduce_scatter([grads[i] for i, _ in buf.params], dp_size))
        grad_norm = self._grad_norm(shards)
        if not torch.isfinite(torch.tensor(grad_norm)):
            return False, grad_norm, None
        coeff = 1.0
        if self.config.clip_grad > 0:
            coeff = min(1.0, self.config.clip_grad / (grad_norm + 1e-6))
        for buf, shard in zip(self.buffers, shards):
            for piece in buf.pieces:
                g = shard[piece.shard_offset:piece.shard_offset + piece.main.numel()]
                piece.main.grad = g.clone() if coeff == 1.0 else g * coeff
        self.optimizer.step()
        for buf in self.buffers:
            buf.all_gather_params()
        return True, grad_norm, None

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: fp32 main slices + optimizer states."""
        n = sum(piece.main.numel() * 4 for buf in self.buffers for piece in buf.pieces)
        for state in self.optimizer.state.values():
            n += sum(t.numel() * t.element_size() for t in state.values()
                     if isinstance(t, torch.Tensor) and t.numel() > 1)
        return n

    def state_dict(self) -> dict:
        """This rank's shard only (checkpoints with DP > 1 are rejected by the flags)."""
        return {"optimizer": self.optimizer.state_dict(),
                "main_params": [piece.main.detach().clone() for buf in self.buffers
                                for piece in buf.pieces]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        pieces = [piece for buf in self.buffers for piece in buf.pieces]
        for piece, saved in zip(pieces, state["main_params"]):
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
        t = torch.tensor([1.0 if local else 0.0,
                          float(local[0].get("step", -1.0)) if local else -1.0])
        for group in (self.dp_group, self.edp_group):
            if group is not None:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        step = torch.tensor(float(t[1]), dtype=torch.float32) if t[1] >= 0 else None
        return bool(t[0]), step

    @torch.no_grad()
    def param_states(self) -> tuple[list[dict[str, torch.Tensor]], Optional[torch.Tensor]]:
        """As MixedPrecisionOptimizer.param_states: the flat shards of every state are
        all-gathered over dp / edp into whole per-parameter tensors (collective)."""
        stepped, step = self._agreed_step()
        names = (["main"] if self.separate_grads else []) + (self._state_names() if stepped
                                                               else [])
        out: list[dict[str, torch.Tensor]] = [{} for _ in self.model_params]
        for buf in self.buffers:
            for name in names:
                shard = torch.zeros(buf.shard_numel, dtype=torch.float32)
                for piece in buf.pieces:
                    src = piece.main if name == "main" else self.optimizer.state[piece.main][name]
                    shard[piece.shard_offset:piece.shard_offset + src.numel()] = src.detach()
                full = shard
                if buf.size > 1:
                    full = torch.empty(buf.numel, dtype=torch.float32)
                    _all_gather(full, shard, group=buf.group)
                for (i, p), off in zip(buf.params, buf.offsets):
                    out[i][name] = full[off:off + p.numel()].view(p.shape).clone()
        return out, step

    @torch.no_grad()
    def load_param_states(self, states: list[dict[str, torch.Tensor]],
                          step: Optional[torch.Tensor]) -> None:
        """Whole per-parameter states (any dp layout they were saved from) -> this rank's
        slices; "main" optional (else the loaded parameter)."""
        for buf in self.buffers:
            for piece in buf.pieces:
                st = states[piece.index]
                main = st["main"] if "main" in st else piece.param.detach()
                piece.main.copy_(main.reshape(-1)[piece.start:piece.end])
                tensors = {k: v.reshape(-1)[piece.start:piece.end].float().clone()
                           for k, v in st.items() if k != "main"}
                if tensors:
                    self.optimizer.state[piece.main] = ({"step": step.clone()}
                                                        if step is not None else {}) | tensors
        for buf in self.buffers:
            buf.all_gather_params()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        for buf in self.buffers:
            for piece in buf.pieces:
                piece.main.copy_(piece.param.detach().reshape(-1)[piece.start:piece.end])
