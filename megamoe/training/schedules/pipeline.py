"""Pipeline-parallel micro-batch schedules: 1F1B and interleaved 1F1B over p2p.

Each rank runs its list of tasks F(chunk, micro-batch) / B(chunk, micro-batch) in the
schedule's order. Activations and gradients cross stages with point-to-point messages:
sends are asynchronous (waited at the end of the step), receives block until the producer
has sent. Because sends never block, the only waits are real data dependencies, so any
order consistent with them (1F1B, Megatron's interleaved order, all-forward for eval)
runs without deadlock on gloo as on NCCL. Messages are tagged by (virtual stage,
micro-batch, direction), so two neighbours exchanging several streams never mix them.

Loss normalisation matches the no-pipelining schedule: the last stage backpropagates
loss / num_microbatches, the MoE aux losses get the same scale, the step's LM loss is
the mean over micro-batches, broadcast from the last stage to the whole pipeline group.
MoE logging values recorded by the layers of each stage are summed over the pipeline
group so every rank reports every layer.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megamoe.model.pipeline_stage import PipelineModel
from megamoe.moe.global_batch import start_global_batch
from megamoe.moe.losses import MoELossTracker, set_aux_loss_backward_scale
from megamoe.training.loss import masked_lm_loss

Batch = dict[str, torch.Tensor]
Task = tuple[str, int, int]  # ("F" | "B", chunk, micro-batch)


def one_f_one_b_order(num_microbatches: int, pp: int, rank: int, num_chunks: int = 1,
                      forward_only: bool = False) -> list[Task]:
    """Megatron's (interleaved) 1F1B task order for `rank`.

    Virtual micro-batch k runs chunk (k mod (pp*V)) // pp of micro-batch
    (k // (pp*V)) * pp + k mod pp; backward visits the chunks in reverse. Warm-up
    forwards fill the pipeline, then one forward and one backward alternate, then the
    cool-down drains the remaining backwards.
    """
    m, v = num_microbatches, num_chunks
    if v > 1 and m % pp:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({m}) "
                         f"to be divisible by --pipeline-model-parallel-size ({pp})")
    total = m * v

    def task(kind: str, k: int) -> Task:
        group, within = divmod(k, pp * v)
        chunk = within // pp
        if kind == "B":
            chunk = v - 1 - chunk
        return kind, chunk, group * pp + within % pp

    if forward_only:
        return [("F", c, mb) for mb in range(m) for c in range(v)]
    if v == 1:
        warmup = min(pp - rank - 1, total)
    else:
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [task("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [task("F", warmup + k), task("B", k)]
    order += [task("B", k) for k in range(total - warmup, total)]
    return order


class _P2P:
    """Tagged point-to-point between virtual stages of one pipeline group."""

    def __init__(self, model: PipelineModel, num_microbatches: int):
        self.model = model
        self.num_virtual = model.pp_size * len(model.chunks)
        self.m = num_microbatches
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _peer(self, stage: int) -> int:
        return self.model.pp_ranks[stage % self.model.pp_size]

    def _tag(self, v: int, mb: int, grad: bool) -> int:
        return 2 * (mb * self.num_virtual + v) + int(grad)

    def send(self, t: torch.Tensor, to_stage: int, v: int, mb: int, grad: bool) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, self._peer(to_stage),
                                        tag=self._tag(v, mb, grad)), t))

    def recv(self, like: torch.Tensor, from_stage: int, v: int, mb: int,
             grad: bool) -> torch.Tensor:
        buf = torch.empty_like(like)
        dist.irecv(buf, self._peer(from_stage), tag=self._tag(v, mb, grad)).wait()
        return buf

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []


def _activation_template(model: PipelineModel, batch: Batch) -> torch.Tensor:
    config, tp = model.config, model.chunks[0].tp
    b, s = batch["tokens"].shape
    if tp.sp:
        s //= tp.size
    dtype = next(model.parameters()).dtype
    return torch.empty(s, b, config.hidden_size, dtype=dtype)


def _sync_moe_logging(model: PipelineModel, num_layers: int) -> None:
    """Sum the per-layer MoE logging values over the pipeline group (each layer lives on
    one stage), then record them back so every stage reports all layers."""
    local = MoELossTracker.report(1)  # {name: values of this stage's MoE layers, by layer}
    moe_layers = sorted(layer.layer_index for chunk in model.chunks for layer in chunk.layers
                        if layer.is_moe)
    names: list[Optional[list[str]]] = [None] * model.pp_size
    dist.all_gather_object(names, sorted(local), group=model.pp_group)
    all_names = sorted({n for per_rank in names for n in per_rank})
    if not all_names:
        return
    values = torch.zeros(len(all_names), num_layers)
    present = torch.zeros(len(all_names), num_layers)
    for i, name in enumerate(all_names):
        if name in local:
            idx = torch.tensor(moe_layers[:len(local[name])], dtype=torch.long)
            values[i, idx] = local[name].float()
            present[i, idx] = 1.0
    stacked = torch.stack([values, present])
    dist.all_reduce(stacked, group=model.pp_group)
    for i, name in enumerate(all_names):
        for layer in range(num_layers):
            if stacked[1, i, layer] > 0:
                MoELossTracker.record(name, layer, num_layers, stacked[0, i, layer])


def forward_backward_pipelining(model: PipelineModel, data_iter: Iterator[Batch],
                                num_microbatches: int, *, forward_only: bool = False
                                ) -> torch.Tensor:
    """Run one global batch through the pipeline; returns the mean LM loss (fp32, on every
    rank of the pipeline group). Gradients accumulate in the chunks' parameters."""
    m = num_microbatches
    batches = [next(data_iter) for _ in range(m)]  # every stage reads the same batches
    set_aux_loss_backward_scale(1.0 / m)
    if not forward_only:
        start_global_batch(model)
    p2p = _P2P(model, m)
    pp, rank, num_chunks = model.pp_size, model.pp_rank, len(model.chunks)
    last_v = pp * num_chunks - 1
    template = _activation_template(model, batches[0])
    saved: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor]] = {}
    total = torch.zeros((), dtype=torch.float32)
    for kind, c, mb in one_f_one_b_order(m, pp, rank, num_chunks, forward_only):
        v = c * pp + rank
        batch = batches[mb]
        if kind == "F":
            inp = None
            if v > 0:
                inp = p2p.recv(template, v - 1, v - 1, mb, grad=False)
                inp.requires_grad_(not forward_only)
            with torch.set_grad_enabled(not forward_only):
                out = model.chunks[c](inp, batch["tokens"], batch.get("position_ids"),
                                      batch["labels"] if v == last_v else None)
                if v == last_v:
                    out = masked_lm_loss(out, batch["loss_mask"])
                    total += out.detach()
            if v < last_v:
                p2p.send(out, v + 1, v, mb, grad=False)
            if not forward_only:
                saved[(c, mb)] = (inp, out)
        else:
            inp, out = saved.pop((c, mb))
            if v == last_v:
                (out / m).backward()
            else:
                grad = p2p.recv(template, v + 1, v, mb, grad=True)
                torch.autograd.backward(out, grad)
            if v > 0:
                p2p.send(inp.grad, v - 1, v - 1, mb, grad=True)
    p2p.finish()
    dist.all_reduce(total, group=model.pp_group)  # only the last stage holds the loss
    _sync_moe_logging(model, model.config.num_layers)
    return total / m
