"""Per-tensor FP8 scaling state of one GEMM operand (n tensors: 1 for a dense linear, one
per local expert for the experts' grouped GEMM). The block-scaled recipes (blocks.py:
blockwise, mxfp8, rowwise) keep no state: their Fp8Meta only names the recipe and dtype.

tensorwise (TE's Float8CurrentScaling): stateless; each tensor is scaled by its own amax at
the moment it is quantised (quantize.current_scale).

delayed (TE's DelayedScaling): the tensor is quantised with the scale computed from earlier
amaxes; its own amax is recorded into the current history slot `amax_history[0]` and used
later. After the step (`Fp8Meta.update`, called once per iteration by policy.Fp8State):
the current slots are max-reduced over the amax group (as TE's
`reduce_and_update_fp8_tensors`), then TE's `_default_get_amax_and_update_history`:
amax = history[0] (most_recent) or max over the window (max); the history rolls by one
(`torch.roll(h, -1, 0)`) and the new current slot is zeroed; then the scale is
quantize.delayed_scale(amax, scale, fp8_max, margin). The state starts as TE's: scale 1,
history zeros.
"""

from __future__ import annotations

import torch

from megamoe.model.fp8.blocks import BLOCK_RECIPES
from megamoe.model.fp8.quantize import FP8_MAX, current_scale, delayed_scale


class Fp8Meta:
    """Scaling of `n` tensors quantised to `dtype` under `recipe`. Tensors live on `device`
    (the mesh's), so the update and its reduction never leave the device."""

    def __init__(self, recipe: str, dtype: torch.dtype, n: int, *, history_len: int = 1,
                 compute_algo: str = "most_recent", margin: int = 0,
                 device: torch.device | str = "cpu") -> None:
        if recipe not in ("tensorwise", "delayed", *BLOCK_RECIPES):
            raise ValueError(f"FP8 recipe {recipe!r} is not built")
        self.recipe, self.dtype, self.n = recipe, dtype, n
        self.fp8_max = FP8_MAX[dtype]
        self.compute_algo, self.margin = compute_algo, margin
        self.delayed = recipe == "delayed"
        if self.delayed:
            self.amax_history = torch.zeros(history_len, n, device=device)
            self.scale = torch.ones(n, device=device)

    def scale_for(self, amax_n: torch.Tensor) -> torch.Tensor:
        """The scales [n] to quantise tensors of amax `amax_n` [n] with, now. Delayed
        scaling records the amaxes in the current history slot (a running max: several
        micro-batches use one slot per step)."""
        if not self.delayed:
            return current_scale(amax_n, self.fp8_max)
        torch.maximum(self.amax_history[0], amax_n, out=self.amax_history[0])
        return self.scale.clone()  # a snapshot: the update must not change saved scales

    @torch.no_grad()
    def update(self) -> None:
        """After the step, once the current slot holds the reduced amaxes: amax from the
        history, roll, zero the new slot, new scale (TE's order and formulas)."""
        if not self.delayed:
            return
        h = self.amax_history
        amax = h.max(dim=0).values if self.compute_algo == "max" else h[0].clone()
        if h.shape[0] > 1:
            h.copy_(torch.roll(h, -1, 0))
        h[0].zero_()
        self.scale.copy_(delayed_scale(amax, self.scale, self.fp8_max, self.margin))

    def state(self) -> dict:
        """A snapshot of the delayed state (for checkpoints)."""
        return {"amax_history": self.amax_history.detach().clone(),
                "scale": self.scale.detach().clone()}

    def load_state(self, state: dict, where: str) -> None:
        """Load a `state()`; shapes and values are checked (a checkpoint is untrusted)."""
        for key, ref in (("amax_history", self.amax_history), ("scale", self.scale)):
            t = state.get(key) if isinstance(state, dict) else None
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 \
                    or tuple(t.shape) != tuple(ref.shape):
                raise ValueError(f"{where}.{key}: expected an fp32 tensor of shape "
                                 f"{tuple(ref.shape)}")
            if not bool(torch.isfinite(t).all()) or bool((t < 0).any()) \
                    or (key == "scale" and bool((t == 0).any())):
                raise ValueError(f"{where}.{key}: values must be finite and "
                                 f"{'positive' if key == 'scale' else 'non-negative'}")
        self.amax_history.copy_(state["amax_history"])
        self.scale.copy_(state["scale"])
