"""--overlap-grad-reduce and --overlap-param-gather (Megatron-Core's DDP buckets).

Gradient reduction overlapped with the backward. The optimizer's parameters are laid out in
buckets in the order the backward produces their gradients (the reverse of the model's
parameter order), dense parameters apart from routed experts (reduced over dp and edp),
each bucket one flat fp32 gradient tensor of about --ddp-bucket-size elements. Each
parameter's post-accumulate-grad hook (registered after the one that adds its gradient
to the bucket) marks it ready, but only in the backward of the last micro-batch of the
step: the schedules say which one that is (`GradReduceOverlap.last_microbatch`, Megatron's
no_sync() around the others; under pipelining, the last backward of each model chunk).
When every parameter of a bucket is ready, the hook launches the bucket's collective
(all-reduce, or the distributed optimizer's reduce-scatter) with async_op=True and
returns: nothing waits inside the backward. `finish()`, called by the optimizer's step
(Megatron's finish_grad_sync in finalize_model_grads), launches what the backward did not
(parameters that got no gradient), waits for every bucket in launch order and divides by
the data-parallel size; the TP / embedding sums, the NaN verdict, the norm, clipping and
the update come after it.

The NaN/Inf check (training/nonfinite.py) must see each rank's own gradients before they
are reduced: each bucket's local norm is taken on the device just before its collective
starts (no host sync), and `finish` returns the rank's verdict.

Parameter all-gather overlapped with the forward (distributed optimizer only): after the
update each bucket's all-gather is launched async (`ParamGatherOverlap.launch`); a forward
pre-hook on every module owning parameters of a bucket waits, before that module runs, for
the buckets holding its parameters and every bucket the forward reaches earlier, so the
late layers' gathers complete while the early layers compute. `wait()` finishes all of them
and is called before anything else reads the parameters (the next step, evaluation,
checkpoints, the end of training).

`events`, when set to a list, records ("launch" | "late_launch" (from finish) | "wait" |
"gather_launch" | "gather_wait", bucket, time.perf_counter()) for the tests that show the
overlap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

Work = Optional[dist.Work]


@dataclass(frozen=True)
class OverlapOptions:
    """What the optimizers need of --overlap-grad-reduce / --overlap-param-gather."""

    bucket_size: int  # elements (bucket_numel of --ddp-bucket-size)
    check_nan: bool = True  # --check-for-nan-in-loss-and-grad: local norms per bucket
    param_gather: bool = False  # --overlap-param-gather (distributed optimizer)


def bucket_numel(bucket_size: Optional[int], dp_size: int) -> int:
    """--ddp-bucket-size, or Megatron's default max(40M, 1M x DP) elements: larger dp needs
    larger buckets for the collectives to stay bandwidth-bound."""
    return bucket_size if bucket_size is not None else max(40_000_000, 1_000_000 * dp_size)


def backward_order(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[int]:
    """Positions in `params` in the reverse of the model's parameter order: the order the
    backward produces gradients in (Megatron's bucket order)."""
    rank = {id(p): i for i, p in enumerate(model.parameters())}
    return sorted(range(len(params)), key=lambda i: -rank[id(params[i])])


def split_buckets(members: list, numel: Callable[[object], int], size: int,
                  alone: Callable[[object], bool] = lambda _m: False) -> list[list]:
    """Megatron's rule: in order, a bucket closes once it holds >= `size` elements; a member
    for which `alone` holds gets a bucket of its own (the distributed optimizer's shared
    embedding, so the first and last pipeline stage shard it identically)."""
    buckets: list[list] = []
    current: list = []
    total = 0
    for m in members:
        if alone(m):
            if current:
                buckets.append(current)
            buckets.append([m])
            current, total = [], 0
            continue
        current.append(m)
        total += numel(m)
        if total >= size:
            buckets.append(current)
            current, total = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(eq=False)
class Bucket:
    """One bucket: its parameters, its local flat gradient (what the NaN check sees),
    `start` (launches the collective, async; None when there is nothing to communicate)
    and `finish` (after the wait: divide by DP)."""

    params: list[torch.nn.Parameter]
    flat_grad: torch.Tensor
    start: Callable[[], Work]
    finish: Callable[[], None]
    ready: set = field(default_factory=set)
    launched: bool = False
    work: Work = None


def allreduce_buckets(params: list[torch.nn.Parameter], order: list[int], size: int,
                      dp_group: Optional[dist.ProcessGroup],
                      edp_group: Optional[dist.ProcessGroup],
                      grad_dtypes: Optional[list[torch.dtype]] = None
                      ) -> tuple[list[torch.Tensor], list[Bucket]]:
    """The plain optimizer's buckets: per bucket one flat gradient tensor (fp32, or each
    parameter's `grad_dtypes` entry: --main-grads-dtype bf16), all-reduced over dp (dense)
    or edp (routed experts, `param.expert_parallel`) and divided by DP (see
    grads.reduce_gradients for why experts too). Returns each parameter's gradient view
    (aligned with `params`: the main gradients) and the buckets."""
    dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
    dtypes = grad_dtypes or [torch.float32] * len(params)
    views: list[Optional[torch.Tensor]] = [None] * len(params)
    buckets = []
    for expert, dtype in ((e, d) for e in (False, True) for d in dict.fromkeys(dtypes)):
        members = [i for i in order if bool(getattr(params[i], "expert_parallel", False))
                   == expert and dtypes[i] == dtype]
        group = edp_group if expert else dp_group
        for part in split_buckets(members, lambda i: params[i].numel(), size):
            flat = torch.zeros(sum(params[i].numel() for i in part), dtype=dtype,
                               device=params[part[0]].device)
            offset = 0
            for i in part:
                views[i] = flat[offset:offset + params[i].numel()].view(params[i].shape)
                offset += params[i].numel()
            buckets.append(Bucket([params[i] for i in part], flat,
                                  _allreduce_start(flat, group), _divide(flat, dp_size)))
    return views, buckets


def _allreduce_start(flat: torch.Tensor, group: Optional[dist.ProcessGroup]
                     ) -> Callable[[], Work]:
    if group is None or dist.get_world_size(group) == 1:
        return lambda: None
    return lambda: dist.all_reduce(flat, group=group, async_op=True)


def _divide(flat: torch.Tensor, divisor: int) -> Callable[[], None]:
    return (lambda: None) if divisor == 1 else (lambda: flat.div_(divisor))


class GradReduceOverlap:
    """The step's bucketed gradient reduction, launched from the backward (module doc)."""

    def __init__(self, buckets: list[Bucket], check_nan: bool, device: torch.device) -> None:
        self.buckets = buckets
        self.check_nan = check_nan
        self.device = device
        self.last_microbatch = False  # set by the schedules around each backward
        self.events: Optional[list] = None
        self._bucket_of = {id(p): b for b in buckets for p in b.params}
        self._launch_order: list[Bucket] = []
        self._bad = torch.zeros((), dtype=torch.bool, device=device)
        for b in buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _record(self, kind: str, bucket: Bucket) -> None:
        if self.events is not None:
            self.events.append((kind, self.buckets.index(bucket), time.perf_counter()))

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook (after the one adding the gradient to the bucket)."""
        if not self.last_microbatch:
            return
        bucket = self._bucket_of[id(param)]
        if id(param) in bucket.ready or bucket.launched:
            raise RuntimeError("a parameter got its gradient twice in the last micro-batch "
                               "of a step: its bucket was already reduced")
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    @torch.no_grad()
    def _launch(self, bucket: Bucket, kind: str = "launch") -> None:
        if self.check_nan:  # this rank's own gradients, before the collective
            local = torch.linalg.vector_norm(bucket.flat_grad, dtype=torch.float32)
            self._bad |= ~torch.isfinite(local)
        bucket.launched = True
        bucket.work = bucket.start()
        self._launch_order.append(bucket)
        self._record(kind, bucket)

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        """Launch the buckets the backward did not, wait for all, divide; returns whether
        this rank's local gradients held a NaN/Inf (a 0-d device bool; False unchecked).
        Resets for the next step."""
        for bucket in self.buckets:
            if not bucket.launched:  # none of its parameters got a gradient this step
                self._launch(bucket, "late_launch")
        for bucket in self._launch_order:
            if bucket.work is not None:
                bucket.work.wait()
            self._record("wait", bucket)
            bucket.finish()
        bad, self._bad = self._bad, torch.zeros((), dtype=torch.bool, device=self.device)
        self.reset()
        return bad

    def reset(self) -> None:
        """Forget the readiness of a step (zero_grad; a step that raised half-way)."""
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.launched, bucket.work = False, None
        self._launch_order = []
        self.last_microbatch = False


class ParamGatherOverlap:
    """The distributed optimizer's parameter all-gathers, overlapped with the next forward
    (module doc). `starts[i]()` launches bucket i's all-gather (async) and returns its work;
    `params[i]` are the bucket's parameters.

    A forward pre-hook on each module owning parameters waits, before the module runs, for
    the buckets holding them and every bucket launched before those. Modules owning
    parameters whose forward never runs (weight holders: the untied output layer, whose
    weight lm_head reads) are found on the first forward, which always precedes the first
    gather (it runs on the initial parameters); their buckets are launched first and
    waited for by the first module the forward calls, so no parameter is read before its
    gather is complete."""

    def __init__(self, model: torch.nn.Module, params: list[list[torch.nn.Parameter]],
                 starts: list[Callable[[], Work]]) -> None:
        self.starts = starts
        self.events: Optional[list] = None
        position = {id(p): i for i, p in enumerate(model.parameters())}
        self._first = [min(position[id(p)] for p in ps) for ps in params]
        bucket_of = {id(p): i for i, ps in enumerate(params) for p in ps}
        self._owned: dict[int, set[int]] = {}  # module -> buckets holding its parameters
        for module in model.modules():
            own = {bucket_of[id(p)] for p in module.parameters(recurse=False)
                   if id(p) in bucket_of}
            if own:
                self._owned[id(module)] = own
                module.register_forward_pre_hook(self._pre_hook)
        self._called: Optional[set[int]] = set()  # modules run so far; None once ordered
        self.order: list[int] = []  # launch order of the buckets
        self._upto: dict[int, int] = {}  # module -> last position in `order` it waits for
        self._pending: list[tuple[int, Work]] = []  # (position in order, work)

    def _pre_hook(self, module: torch.nn.Module, _args) -> None:
        if self._called is not None:  # before the first launch: nothing is in flight
            self._called.add(id(module))
        elif self._pending:
            self._wait(self._upto[id(module)])

    def _fix_order(self) -> None:
        """Weight holders' buckets first, then the rest in the order the forward needs."""
        called = self._called or set()
        holders = {b for m, own in self._owned.items() if m not in called for b in own}
        rest = [b for b in range(len(self.starts)) if b not in holders]
        self.order = (sorted(holders, key=lambda b: self._first[b])
                      + sorted(rest, key=lambda b: self._first[b]))
        at = {b: k for k, b in enumerate(self.order)}
        self._upto = {m: max([at[b] for b in own] + [len(holders) - 1])
                      for m, own in self._owned.items()}
        self._called = None

    def launch(self) -> None:
        """After the update: start every bucket's all-gather."""
        self.wait()
        if self._called is not None:
            self._fix_order()
        for k, b in enumerate(self.order):
            self._pending.append((k, self.starts[b]()))
            self._record("gather_launch", b)

    def _wait(self, upto: int) -> None:
        while self._pending and self._pending[0][0] <= upto:
            k, work = self._pending.pop(0)
            if work is not None:
                work.wait()
            self._record("gather_wait", self.order[k])

    def wait(self) -> None:
        """Every pending all-gather done: the model parameters are this step's."""
        self._wait(len(self.order))

    def _record(self, kind: str, bucket: int) -> None:
        if self.events is not None:
            self.events.append((kind, bucket, time.perf_counter()))
