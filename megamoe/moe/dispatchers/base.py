"""What every token dispatcher does: move the routed token copies to the experts that own
them and bring the weighted expert outputs back.

An MoE layer always has exactly one dispatcher (`MoELayer.dispatcher`): `LocalDispatcher`
when the experts live on this rank, `AllToAllDispatcher` / `AllGatherDispatcher` under
expert parallelism, `TensorParallelDispatcher` around either under tensor + sequence
parallelism, and `AdaptiveDispatcher` (adaptive parallelism) around an expert-parallel
one. The parallelize step chooses it; the layer only calls it:

    inputs, state = dispatcher.dispatch(x_TH, probs_TE, routing_map_TE, pad)
    y = experts(*inputs)
    out_TH = dispatcher.combine(y, state)

`forward` does exactly that (with the shared expert's halves between, under
--moe-shared-expert-overlap); a dispatcher that overlaps communication with the expert
GEMMs or picks an execution mode per call overrides `forward` and keeps the meaning.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch

Experts = Callable[..., torch.Tensor]


class SharedHalves(Protocol):
    """The shared expert's two halves (moe/shared_overlap.py's SharedExpertOverlap)."""

    def fc1(self) -> None: ...

    def fc2(self) -> None: ...


class TokenDispatcher:
    """Base: this rank's experts get rows grouped by local expert, with the rows per local
    expert as a device tensor or, where the dispatcher has them on the host anyway, a
    GroupSizes carrying both (moe/grouped_gemm.py); the combine returns [T, H] for this
    rank's tokens."""

    def gather_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input -> the tokens this rank routes (identity unless a tensor-
        parallel wrapper gathers the sequence)."""
        return hidden

    def capacity_shards(self) -> int:
        """Capacity is counted separately in this many equal, contiguous blocks of the
        routed tokens (moe/capacity.py); `pad` is then rows per expert per block."""
        return 1

    def mode_for(self, parallel_mode: Optional[str], adaptive_r: Optional[int]
                 ) -> Optional[str]:
        """The execution mode a caller asks for; only adaptive parallelism has modes."""
        if parallel_mode is not None or adaptive_r is not None:
            raise ValueError("parallel_mode / adaptive_r need an expert-parallel layer with "
                             "adaptive parallelism (--moe-adaptive-parallelism)")
        return None

    def dispatch(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                 routing_map_TE: torch.Tensor, pad: Optional[int] = None
                 ) -> tuple[tuple, Any]:
        """-> (the experts' positional inputs, state for `combine`)."""
        raise NotImplementedError

    def combine(self, y_NH: torch.Tensor, state: Any) -> torch.Tensor:
        """The experts' output rows (dispatch order) -> [T, H] for this rank's tokens."""
        raise NotImplementedError

    def forward(self, x_TH: torch.Tensor, probs_TE: torch.Tensor,
                routing_map_TE: torch.Tensor, experts: Experts, pad: Optional[int] = None,
                mode: Optional[str] = None, shared: Optional[SharedHalves] = None
                ) -> torch.Tensor:
        """dispatch -> experts -> combine; `shared` (--moe-shared-expert-overlap,
        moe/shared_overlap.py) has its halves run after the dispatch and the combine (an
        asynchronous dispatcher runs them while its exchanges are in flight)."""
        inputs, state = self.dispatch(x_TH, probs_TE, routing_map_TE, pad)
        if shared is not None:
            shared.fc1()
        out_TH = self.combine(experts(*inputs), state)
        if shared is not None:
            shared.fc2()
        return out_TH

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    def inner_dispatchers(self) -> list[TokenDispatcher]:
        """This dispatcher and the ones it wraps, outermost first."""
        inner = getattr(self, "inner", None)
        return [self] + (inner.inner_dispatchers() if inner is not None else [])
