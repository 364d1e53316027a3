"""Device->host synchronisations in the MoE hot path, counted on CPU.

A GPU keeps running ahead of the Python thread until the host needs a value the device
computes: a scalar (`.item()`, `int(t)`, `bool(t)`), a list (`.tolist()`), a host copy
(`.cpu()`, `.to("cpu")`), or an op whose *output shape* depends on the data (`nonzero`,
`masked_select`, boolean-mask indexing, `unique`, `repeat_interleave` without
`output_size`, ...: the caching allocator needs the size on the host before it can
allocate the result, so the op copies a count back and waits). Each one drains the stream:
the CPU stops queueing kernels until every kernel queued before it has finished.

On CPU every tensor is a host tensor, so nothing here blocks and the copy ops are no-ops
that do not even reach the dispatcher (`t.tolist()` and `t.to("cpu")` of a CPU tensor are
invisible to a TorchDispatchMode on torch 2.13: tolist reads the memory directly, `to`
returns `self`). The counter therefore counts by *kind of call*, i.e. what would block if
the tensor lived on a GPU, in two ways:

  TorchDispatchMode (aten level), the data-dependent ops and scalar reads:
    aten._local_scalar_dense           item(), int(t), float(t), bool(t), t.__index__
    aten.nonzero (not nonzero_static)  output size = number of non-zeros
    aten.masked_select                 output size = mask.sum()
    aten.index / index_put(_) with a bool or uint8 index  (a nonzero inside)
    aten.repeat_interleave.Tensor without output_size     (output size = repeats.sum())
    aten._unique, _unique2, unique_dim, unique_consecutive, unique_dim_consecutive
    aten.bincount                      output size = max(input) + 1
    aten.equal                         returns a Python bool
    aten._to_copy / copy_ between the CPU and another device, either way (a blocking
                                       copy: torch synchronises the stream after a
                                       non_blocking=False copy; never seen on CPU, counted
                                       for completeness)
  Wrapped Python calls, the copies that leave no aten trace on CPU:
    Tensor.tolist, Tensor.cpu, Tensor.numpy, Tensor.to("cpu") / to(device="cpu")
    torch.tensor / torch.as_tensor with a device other than the string "cpu"
                                       (host data copied to the device: a blocking H2D
                                       copy; `device="cpu"` is host metadata on purpose)
    (while one of these runs, the aten counter is muted, so a tolist on a GPU, which is an
    aten._to_copy to the CPU, counts once).

Not counted, because a GPU does not block on them: nonzero_static, repeat_interleave with
output_size, _assert_async (a device-side assert), collectives (their split sizes are
host lists already), fills (torch.full, arange), Python scalars as kernel arguments, ops
on shapes. Limits of counting on CPU: `t.to(x.device)` is taken for a move between
devices of the same kind and not counted (on a GPU it may be a host->device copy); a
`.to("cpu")` or `.tolist()` of a tensor that is host metadata on purpose is counted (the
MoE hot path has none).
"""

from __future__ import annotations

import collections
import contextlib
import os
import traceback
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megamoe.config import MoEConfig
from megamoe.moe.grouped_gemm import resolve_backend
from megamoe.moe.layer import MoELayer
from tests.distributed import run_distributed

aten = torch.ops.aten
_ALWAYS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique,
           aten._unique2, aten.unique_dim, aten.unique_consecutive,
           aten.unique_dim_consecutive, aten.bincount, aten.equal}
_BOOL_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_HOST_COPIES = ("tolist", "cpu", "numpy", "to")  # Tensor methods; "to" only to "cpu"
_FROM_HOST_DATA = ("tensor", "as_tensor")  # torch functions; only onto a device
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _is_cpu(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _to_cpu_target(args: tuple, kwargs: dict) -> bool:
    """Whether a Tensor.to(...) call names the CPU by name: t.to("cpu"), to(device="cpu").

    A torch.device object or a tensor argument is taken for "the device of some tensor"
    (`device=x.device`), which is the CPU here only because the test runs there."""
    device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, str)), None))
    return isinstance(device, str) and _is_cpu(device)


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices or [])


def _onto_device(kwargs: dict) -> bool:
    """torch.tensor(data, device=...) with a device that is not the string "cpu"."""
    device = kwargs.get("device")
    return device is not None and not (isinstance(device, str) and _is_cpu(device))


def _crosses_host(func, args: tuple, kwargs: dict) -> bool:
    """A copy between the CPU and another device, either way."""
    packet = func.overloadpacket
    if packet is aten._to_copy:
        src = args[0]
        dst_device = torch.device(kwargs.get("device") or src.device)
        return (src.device.type == "cpu") != (dst_device.type == "cpu")
    if packet is aten.copy_:
        dst, src = args[0], args[1]
        return (dst.device.type == "cpu") != (src.device.type == "cpu")
    return False


def syncing_op(func, args: tuple, kwargs: dict) -> bool:
    """Whether this aten call would make the host wait for a GPU (module docstring)."""
    packet = func.overloadpacket
    if packet in _ALWAYS:
        return True
    if packet in _BOOL_INDEXED:
        return _bool_index(args)
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return _crosses_host(func, args, kwargs)


def _where() -> str:
    """The innermost frame of the package (or, failing that, of the tests) that called."""
    frames = traceback.extract_stack()
    for prefix in ("megamoe", "tests"):
        for f in reversed(frames):
            rel = os.path.relpath(f.filename, _REPO)
            if rel.startswith(prefix + os.sep) and not rel.endswith("test_host_syncs.py"):
                return f"{rel}:{f.lineno}"
    return "?"


class HostSyncCounter:
    """`with HostSyncCounter() as c: ...` -> c.total, c.by_op ({name: n}), c.events
    ([(name, file:line)]). Counts what would block a GPU (module docstring).

    The aten ops are seen by a TorchDispatchMode, which autograd carries into the
    backward. The host copies are seen by wrapping the Tensor methods for the duration:
    a TorchFunctionMode would miss the ones made in a custom autograd Function's backward
    (torch 2.13 does not carry torch-function modes into the backward)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self._muted = 0
        self._saved: dict[str, tuple[Any, Any]] = {}
        counter = self

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if not counter._muted and syncing_op(func, args, kwargs):
                    counter.events.append((str(func.overloadpacket.__name__), _where()))
                return func(*args, **kwargs)

        self._dispatch = _Dispatch()

    def _wrap(self, name: str, method):
        counter = self

        def counted(*args, **kwargs):
            if counter._muted or (name == "to" and not _to_cpu_target(args, kwargs)) or (
                    name in _FROM_HOST_DATA and not _onto_device(kwargs)):
                return method(*args, **kwargs)
            counter.events.append((name, _where()))
            counter._muted += 1  # a GPU tolist is also an aten._to_copy: count it once
            try:
                return method(*args, **kwargs)
            finally:
                counter._muted -= 1

        return counted

    def __enter__(self) -> HostSyncCounter:
        for owner, names in ((torch.Tensor, _HOST_COPIES), (torch, _FROM_HOST_DATA)):
            for name in names:
                own = vars(owner).get(name)  # None: inherited (torch.Tensor from TensorBase)
                self._saved[name] = (owner, own)
                setattr(owner, name, self._wrap(name, getattr(owner, name)))
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._dispatch.__exit__(*exc)
        for name, (owner, own) in self._saved.items():
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._saved.clear()

    @contextlib.contextmanager
    def muted(self):
        """Count nothing inside: for a test's stand-in of a host-side library (reading
        host memory it was handed is no sync)."""
        self._muted += 1
        try:
            yield
        finally:
            self._muted -= 1

    @property
    def total(self) -> int:
        return len(self.events)

    @property
    def by_op(self) -> dict[str, int]:
        return dict(collections.Counter(name for name, _ in self.events))

    def __repr__(self) -> str:
        return f"HostSyncCounter({self.total}: {self.events})"


def test_counter_counts_what_would_block_a_gpu():
    """The counter itself: each kind of call it promises to count, once; none of the
    non-blocking look-alikes."""
    t = torch.tensor([3, 1, 2])
    x = torch.randn(3, requires_grad=True)
    with HostSyncCounter() as c:
        t.tolist()
        int(t[0])
        float(t[0])
        bool(t[0])
        t[0].item()
        t.cpu()
        t.numpy()
        t.to("cpu")
        torch.repeat_interleave(t)
        t.nonzero()
        t[t > 1]
        torch.tensor([1, 2], device=t.device)
        (x * 2).sum().backward()  # backward of ordinary ops: nothing
    assert c.by_op == {"tolist": 1, "_local_scalar_dense": 4, "cpu": 1, "numpy": 1, "to": 1,
                       "repeat_interleave": 1, "nonzero": 1, "index": 1, "tensor": 1}, c
    with HostSyncCounter() as quiet:
        torch.repeat_interleave(t, output_size=6)
        torch.nonzero_static(t, size=3)
        t.to(t.device)
        t.to(torch.float32)
        torch.tensor([1, 2], device="cpu")  # host metadata on purpose
        torch.full((2,), 5, device=t.device)
        t.cumsum(0)
    assert quiet.total == 0, quiet
    assert "tolist" not in vars(torch.Tensor)  # the wrapped methods are restored


class _TolistInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        g.tolist()
        return g * 2


def test_counter_sees_custom_backward():
    """Host copies in a custom Function's backward count too (why the methods are wrapped
    rather than watched by a TorchFunctionMode, which torch does not carry into backward)."""
    y = _TolistInBackward.apply(torch.randn(3, requires_grad=True))
    with HostSyncCounter() as c:
        y.sum().backward()
    assert c.by_op == {"tolist": 1}, c


# ---- the MoE layer, one rank -------------------------------------------------------------

E, K, H, F_ = 4, 2, 16, 32  # 16-byte rows: the "torch" grouped GEMM backend runs

LAYER_CASES = {
    # name: (MoELayer options, syncs allowed in forward + backward)
    "swiglu": (dict(), 1),
    "gelu_bias": (dict(swiglu=False, add_bias_linear=True), 1),
    "all_losses_expert_bias": (dict(load_balancing_types=["aux_loss", "seq_aux_loss",
                                                          "global_aux_loss"],
                                    aux_loss_coeffs=[1e-2, 1e-2, 1e-2], z_loss_coeff=1e-3,
                                    score_function="sigmoid", enable_expert_bias=True), 1),
    "capacity_drop": (dict(capacity_factor=1.0), 1),
    "capacity_padded": (dict(capacity_factor=1.0, pad_to_capacity=True), 0),
}


def _layer_syncs(options: dict) -> tuple[HostSyncCounter, HostSyncCounter, str]:
    options = dict(options)
    layer_args = {k: options.pop(k) for k in ("swiglu", "add_bias_linear") if k in options}
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, topk=K, ffn_hidden_size=F_, **options)
    layer = MoELayer(cfg, H, init_method_std=0.3, grouped_gemm=True, **layer_args)
    x = torch.randn(6, 2, H, requires_grad=True)
    layer(x).sum().backward()  # warm-up: lazy initialisation is not the hot path
    backend = resolve_backend(x.reshape(-1, H), layer.experts.fc1_weight, "auto")
    with HostSyncCounter() as fwd:
        out = layer(x)
    with HostSyncCounter() as bwd:
        out.sum().backward()
    return fwd, bwd, backend


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_single_rank_layer_syncs(case):
    """MoE layer forward + backward on one rank, grouped experts (grouped_gemm=True): the
    dropless path syncs once (the permutation's nonzero: N is data-dependent), the
    capacity-padded one never (static sizes); the backward never."""
    options, allowed = LAYER_CASES[case]
    fwd, bwd, backend = _layer_syncs(options)
    assert backend == "torch"
    assert bwd.total == 0, bwd
    assert fwd.total <= allowed, fwd
    if allowed:
        assert fwd.events[0][1].startswith("megamoe/moe/permute.py"), fwd


# ---- expert parallelism, 2 gloo ranks ----------------------------------------------------

# (dispatcher, overlap degree, experts): grouped ("torch" backend), grouped with the
# per-expert loop backend, user modules (SequentialExperts). The latter two need the rows
# per local expert on the host: the all-to-all hands them over with its one copy.
# "shared": grouped, plus a gated shared expert under --moe-shared-expert-overlap.
EP_CASES = [("alltoall", 1, "grouped"), ("alltoall", 2, "grouped"), ("alltoall", 1, "loop"),
            ("alltoall", 2, "modules"), ("allgather", 1, "grouped"), ("alltoall", 1, "shared")]


def _ep_layer(dispatcher: str, overlap: int, experts: str):
    import torch.distributed as dist

    from megamoe.config import MoEExecutionConfig
    from megamoe.parallelize import parallelize_moe

    torch.manual_seed(0)
    modules = None
    if experts == "modules":
        modules = [torch.nn.Sequential(torch.nn.Linear(H, F_), torch.nn.GELU(),
                                       torch.nn.Linear(F_, H)) for _ in range(E)]
    shared = experts == "shared"
    layer = MoELayer(hidden_size=H, experts=modules, num_experts=E, topk=K,
                     ffn_hidden_size=F_, aux_loss_coeffs=[0.0], init_method_std=0.3,
                     grouped_gemm=experts in ("grouped", "shared"),
                     shared_expert_intermediate_size=F_ if shared else None,
                     shared_expert_gate=shared)
    return parallelize_moe(layer, ep_group=dist.group.WORLD, execution=MoEExecutionConfig(
        token_dispatcher_type=dispatcher, a2a_overlap_degree=overlap,
        shared_expert_overlap=shared))


def _ep_worker(rank: int, world: int) -> list:
    out = []
    for case in EP_CASES:
        layer = _ep_layer(*case)
        x = torch.randn(7, H, generator=torch.Generator().manual_seed(rank),
                        requires_grad=True)  # 7 tokens: uneven overlap chunks
        layer(x).sum().backward()
        with HostSyncCounter() as fwd:
            y = layer(x)
        with HostSyncCounter() as bwd:
            y.sum().backward()
        out.append((fwd.events, bwd.events))
    return out


def _where_from(events: list, module: str) -> list:
    return [name for name, where in events if where.startswith(f"megamoe/moe/{module}")]


def test_expert_parallel_syncs():
    """2 gloo ranks. All-to-all: the permutation's one sync plus exactly one device->host
    copy of the split sizes per forward, also with overlap degree 2 (one copy for every
    chunk's sizes) and with experts that need their group sizes on the host; the
    backward adds none. All-gather: the permutation's one sync."""
    results = run_distributed(_ep_worker, 2, 120)
    for rank_results in results:
        for (dispatcher, overlap, experts), (fwd, bwd) in zip(EP_CASES, rank_results):
            where = f"{dispatcher}, overlap {overlap}, {experts}: forward {fwd}, backward {bwd}"
            assert bwd == [], where
            assert _where_from(fwd, "permute.py") == ["nonzero"], where
            if dispatcher == "alltoall":
                assert _where_from(fwd, "dispatchers/alltoall.py") == ["tolist"], where
                assert len(fwd) == 2, where
            else:
                assert len(fwd) == 1, where
