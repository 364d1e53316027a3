"""Pipeline-parallel micro-batch schedules: 1F1B and interleaved 1F1B over p2p.

Each rank runs its tasks F(chunk, micro-batch) / B(chunk, micro-batch) as a list of
steps (`pipeline_steps`, Megatron-LM's order), and between two steps exchanges with its
two neighbours in one `dist.batch_isend_irecv`, waited before the next step: the sends of
the step just run (F's output to the next stage, B's input gradient to the previous one)
and the receives the next step needs (F's input from the previous stage, B's output
gradient from the next one). With one virtual stage (1F1B) a step is one task; with
interleaving, a steady-state step is F and B together, as in Megatron-LM.

Ordering, for NCCL. NCCL ignores tags: on each pair of ranks, sends are matched to the
peer's receives in issue order, and a send may block until its receive is posted (a
batch completes only when all of its operations have). Separate isend/irecv calls in
the order the tasks produce them deadlock (both neighbours sending first) or, when
interleaving, pair an activation with a same-shaped gradient. So, as in Megatron-LM:
- every receive is posted in the batch just before the step that needs it and every send
  in the batch just after the step that produced it; the steps are Megatron's, whose
  warm-ups differ by one task (1F1B) or two steps (interleaved) between neighbours, so
  the batches of neighbours line up: in the steady state of 1F1B, rank r's "send forward,
  receive backward" meets rank r+1's "send backward, receive forward"; when interleaving,
  rank r's batch after step s meets rank r+1's after step s-1 (and rank pp-1's meets
  rank 0's for the wrap-around between chunks; where few micro-batches cap the warm-up,
  one batch may meet parts of two of the neighbour's, in the same order);
- inside a batch the operations follow Megatron's even/odd order (even ranks: send next,
  recv prev, send prev, recv next; odd ranks: recv prev, send next, recv next, send prev):
  towards the next rank it is always "send, then receive", towards the previous one
  "receive, then send", which mirror each other, also with PP = 2 where both neighbours
  are the same rank;
- forward-only (evaluation) runs the same forward order, all warm-up.
The result: on every pair (a, b), the operations a issues towards b are, one to one and in
order, the mirror of those b issues towards a, and every rank runs to the end even when
each send waits for its receive. tests/training/test_p2p_order.py records the operations
of every rank, ignoring tags, and checks both (the latter with an NCCL-like rendezvous
simulation) for 1F1B and interleaving, PP = 2 and 4, training and forward-only. Each
message still carries a tag naming it (virtual stage, micro-batch, direction): NCCL ignores
it, gloo matches by it, and the test uses it only to check that the messages matched by
position are the same. Receive buffers are allocated on the parameters' device in the
activation dtype.

Loss normalisation matches the no-pipelining schedule: the last stage backpropagates
each micro-batch's share of the step's loss (training/loss.py), the MoE aux losses are
scaled by 1 / num_microbatches, the step's LM loss (the sum of the shares) is broadcast
from the last stage to the whole pipeline group.
MoE logging values recorded by the layers of each stage are summed over the pipeline
group so every rank reports every layer.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megamoe.model.mtp import MTPLossTracker
from megamoe.model.pipeline_stage import PipelineModel
from megamoe.moe.global_batch import start_global_batch
from megamoe.moe.losses import MoELossTracker, set_aux_loss_backward_scale
from megamoe.training.cp_batch import context_parallel_of, split_batch
from megamoe.training.loss import PerTokenLoss, step_share
from megamoe.training.schedules.local import GradSync

Batch = dict[str, torch.Tensor]
Task = tuple[str, int, int]  # ("F" | "B", chunk, micro-batch)
Message = tuple[torch.Tensor, int]  # (tensor, tag)

# Operations of one batch, in issue order (Megatron-LM's even/odd pipeline ranks).
_SLOTS = {0: (("send", "next"), ("recv", "prev"), ("send", "prev"), ("recv", "next")),
          1: (("recv", "prev"), ("send", "next"), ("recv", "next"), ("send", "prev"))}


def pipeline_steps(num_microbatches: int, pp: int, rank: int, num_chunks: int = 1,
                   forward_only: bool = False) -> list[list[Task]]:
    """Megatron's (interleaved) 1F1B task order for `rank`, cut into the steps between
    which the rank communicates.

    Virtual micro-batch k runs chunk (k mod (pp*V)) // pp of micro-batch
    (k // (pp*V)) * pp + k mod pp; backward visits the chunks in reverse. Warm-up
    forwards fill the pipeline, then one forward and one backward alternate (one step
    each in 1F1B, one step together when interleaved), then the cool-down drains the
    remaining backwards. Forward-only runs every forward in warm-up order.
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
        return [[task("F", k)] for k in range(total)]
    if v == 1:
        warmup = min(pp - rank - 1, total)
    else:
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    steps = [[task("F", k)] for k in range(warmup)]
    for k in range(total - warmup):
        pair = [task("F", warmup + k), task("B", k)]
        steps += [pair] if v > 1 else [pair[:1], pair[1:]]
    return steps + [[task("B", k)] for k in range(total - warmup, total)]


def one_f_one_b_order(num_microbatches: int, pp: int, rank: int, num_chunks: int = 1,
                      forward_only: bool = False) -> list[Task]:
    """The tasks of `pipeline_steps`, in order."""
    return [t for step in pipeline_steps(num_microbatches, pp, rank, num_chunks, forward_only)
            for t in step]


class _P2P:
    """Batched point-to-point with this rank's two neighbours in the pipeline (the same
    rank when PP = 2); see the module docstring for the order."""

    def __init__(self, model: PipelineModel, template: torch.Tensor):
        pp, rank = model.pp_size, model.pp_rank
        self.peers = {"next": model.pp_ranks[(rank + 1) % pp],
                      "prev": model.pp_ranks[(rank - 1) % pp]}
        self.slots = _SLOTS[rank % 2]
        self.group = model.pp_group
        self.template = template

    def exchange(self, sends: dict[str, Message], recvs: dict[str, int]
                 ) -> dict[str, torch.Tensor]:
        """One batch: send `sends[direction]` to that neighbour and receive a tensor shaped
        like the template from each direction of `recvs` (direction: tag); waits."""
        ops, received = [], {}
        for kind, direction in self.slots:
            if kind == "send" and direction in sends:
                t, tag = sends[direction]
                ops.append(dist.P2POp(dist.isend, t.detach().contiguous(),
                                      self.peers[direction], self.group, tag))
            elif kind == "recv" and direction in recvs:
                received[direction] = buf = torch.empty_like(self.template)
                ops.append(dist.P2POp(dist.irecv, buf, self.peers[direction], self.group,
                                      recvs[direction]))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received


def _activation_template(model: PipelineModel, batch: Batch) -> torch.Tensor:
    """An empty [S(/TP), B, H] tensor on the parameters' device, in the activation dtype."""
    config, tp = model.config, model.chunks[0].tp
    b, s = batch["tokens"].shape
    if tp.sp:
        s //= tp.size
    param = next(model.parameters())
    return torch.empty(s, b, config.hidden_size, dtype=param.dtype, device=param.device)


class _Stages:
    """This rank's compute: F runs a chunk on a micro-batch, B backpropagates it."""

    def __init__(self, model: PipelineModel, batches: list[Batch], forward_only: bool,
                 grad_sync: Optional[GradSync] = None,
                 per_token: Optional[PerTokenLoss] = None, loss_scale: float = 1.0):
        self.model, self.batches, self.forward_only = model, batches, forward_only
        self.loss_scale = loss_scale  # (--fp16) the last stage's backward starts with it
        self.cp = context_parallel_of(model)
        self.grad_sync, self.per_token = grad_sync, per_token
        self.num_virtual = model.pp_size * len(model.chunks)
        self.saved: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        device = next(model.parameters()).device
        self.total = torch.zeros((), dtype=torch.float32, device=device)  # sum of loss shares

    def _virtual(self, chunk: int) -> int:
        return chunk * self.model.pp_size + self.model.pp_rank

    def _tag(self, v: int, mb: int, grad: bool) -> int:
        """Names the message sent by virtual stage v: NCCL ignores it, gloo matches by it,
        the order is correct without it (the tests check the two agree)."""
        return 2 * (mb * self.num_virtual + v) + int(grad)

    def inbound(self, step: list[Task]) -> dict[str, int]:
        """{direction: tag} of what `step` receives: F's input from the previous stage,
        B's output gradient from the next one."""
        out = {}
        for kind, c, mb in step:
            v = self._virtual(c)
            if kind == "F" and v > 0:
                out["prev"] = self._tag(v - 1, mb, grad=False)
            elif kind == "B" and v < self.num_virtual - 1:
                out["next"] = self._tag(v + 1, mb, grad=True)
        return out

    def run(self, task: Task, received: dict[str, torch.Tensor]) -> dict[str, Message]:
        """Run one task on what the last batch received; returns what it sends."""
        kind, c, mb = task
        if kind == "F":
            return self._forward(c, mb, received.get("prev"))
        return self._backward(c, mb, received.get("next"))

    def _forward(self, c: int, mb: int, inp: Optional[torch.Tensor]) -> dict[str, Message]:
        v, batch, last = self._virtual(c), self.batches[mb], self.num_virtual - 1
        if inp is not None:
            inp.requires_grad_(not self.forward_only)
        with torch.set_grad_enabled(not self.forward_only):
            out = self.model.chunks[c](inp, batch["tokens"], batch.get("position_ids"),
                                       batch["labels"] if v == last else None,
                                       batch.get("document_ids"),
                                       batch["loss_mask"] if v == last else None,
                                       self.per_token.mtp_scales
                                       if v == last and self.per_token is not None else None)
            if v == last:
                out = step_share(out, batch["loss_mask"], self.cp, len(self.batches),
                                 self.per_token)
                self.total += out.detach()
        if not self.forward_only:
            self.saved[(c, mb)] = (inp, out)
        return {} if v == last else {"next": (out, self._tag(v, mb, grad=False))}

    def _backward(self, c: int, mb: int, grad: Optional[torch.Tensor]) -> dict[str, Message]:
        inp, out = self.saved.pop((c, mb))
        v = self._virtual(c)
        if self.grad_sync is not None:  # a chunk's backwards run in micro-batch order
            self.grad_sync.last_microbatch = mb == len(self.batches) - 1
        if v == self.num_virtual - 1:  # out is the loss share
            (out * self.loss_scale if self.loss_scale != 1.0 else out).backward()
        else:
            torch.autograd.backward(out, grad)
        return {"prev": (inp.grad, self._tag(v, mb, grad=True))} if v > 0 else {}


def _sync_moe_logging(model: PipelineModel, num_layers: int) -> None:
    """Sum the per-layer MoE logging values over the pipeline group (each layer lives on
    one stage), then record them back so every stage reports all layers. Which stage holds
    which layers' values does not change from step to step: it is exchanged once (an
    object all-gather, host reads) per model and mode (training or evaluation), so a step
    sums the values on the device and reads nothing back."""
    local = MoELossTracker.report(1)  # {name: values of this stage's MoE layers, by layer}
    moe_layers = sorted(layer.layer_index for chunk in model.chunks for layer in chunk.layers
                        if layer.is_moe)
    moe_layers += [mtp_layer.transformer_layer.layer_index for chunk in model.chunks
                   if chunk.mtp is not None for mtp_layer in chunk.mtp.layers
                   if mtp_layer.transformer_layer.is_moe]  # after the decoder's
    own = {name: moe_layers[:len(v)] for name, v in local.items()}
    present = _logged_layers(model, own)  # {name: [layers some stage recorded]}
    if not present:
        return
    device = next(model.parameters()).device
    zero = torch.zeros((), dtype=torch.float32, device=device)
    rows = []
    for name in sorted(present):
        by_layer = dict(zip(own.get(name, []), local[name].float().unbind())
                        if name in local else [])
        rows.append(torch.stack([by_layer.get(layer, zero) for layer in range(num_layers)]))
    summed = torch.stack(rows)
    dist.all_reduce(summed, group=model.pp_group)
    for i, name in enumerate(sorted(present)):
        for layer in present[name]:
            MoELossTracker.record(name, layer, num_layers, summed[i, layer])


def _logged_layers(model: PipelineModel, own: dict[str, list[int]]) -> dict[str, list[int]]:
    """{name: the layers, over all stages, that record MoE logging value `name`}, from one
    object all-gather over the pipeline group the first time per mode; cached on the model
    (each stage's layers and losses are fixed once it is built)."""
    cache = model.__dict__.setdefault("_moe_logged_layers", {})
    if model.training not in cache:
        gathered: list[Optional[dict]] = [None] * model.pp_size
        dist.all_gather_object(gathered, own, group=model.pp_group)
        merged: dict[str, set[int]] = {}
        for per_rank in gathered:
            for name, layers in (per_rank or {}).items():
                merged.setdefault(name, set()).update(layers)
        cache[model.training] = (own, {n: sorted(v) for n, v in merged.items()})
    seen, present = cache[model.training]
    if own != seen:  # a stage's recorded losses changed: the exchange would be stale
        raise RuntimeError(f"MoE logging values changed between steps: {seen} -> {own}")
    return present


def _sync_mtp_logging(model: PipelineModel, device: torch.device) -> None:
    """The MTP losses live on the last stage: sum them over the pipeline group (zeros
    elsewhere) so every stage reports them."""
    values = MTPLossTracker.take()
    if values is None:
        values = torch.zeros(model.config.mtp_num_layers, dtype=torch.float32, device=device)
    dist.all_reduce(values, group=model.pp_group)
    MTPLossTracker.put(values)


def forward_backward_pipelining(model: PipelineModel, data_iter: Iterator[Batch],
                                num_microbatches: int, *, forward_only: bool = False,
                                grad_sync: Optional[GradSync] = None,
                                per_token: Optional[PerTokenLoss] = None,
                                loss_scale: float = 1.0) -> torch.Tensor:
    """Run one global batch through the pipeline; returns this rank's part of the step's
    LM loss (fp32, on every rank of the pipeline group, unscaled). Gradients accumulate in
    the chunks' parameters; `grad_sync` learns which backward is each chunk's last of the
    step; `per_token`: --calculate-per-token-loss; `loss_scale` (--fp16) multiplies the
    backward, the gradients sent between stages included."""
    m = num_microbatches
    cp = context_parallel_of(model)  # this cp rank's chunks of each batch
    read = [next(data_iter) for _ in range(m)]  # the same on every stage
    if per_token is not None:  # every stage counts (evaluation reads the count)
        per_token.start_step(read, cp)
    batches = [split_batch(b, cp) for b in read]
    set_aux_loss_backward_scale(1.0 / m, loss_scale)
    if not forward_only:
        start_global_batch(model)
    stages = _Stages(model, batches, forward_only, grad_sync, per_token, loss_scale)
    p2p = _P2P(model, _activation_template(model, batches[0]))
    steps = pipeline_steps(m, model.pp_size, model.pp_rank, len(model.chunks), forward_only)
    received = p2p.exchange({}, stages.inbound(steps[0]))
    for i, step in enumerate(steps):
        sends: dict[str, Message] = {}
        for task in step:
            sends.update(stages.run(task, received))
        following = steps[i + 1] if i + 1 < len(steps) else []
        received = p2p.exchange(sends, stages.inbound(following))
    if grad_sync is not None:
        grad_sync.last_microbatch = False
    dist.all_reduce(stages.total, group=model.pp_group)  # only the last stage holds the loss
    config = model.config
    _sync_moe_logging(model, config.num_layers + config.num_mtp_layers)
    if config.mtp_num_layers and not forward_only:
        _sync_mtp_logging(model, stages.total.device)
    return stages.total
