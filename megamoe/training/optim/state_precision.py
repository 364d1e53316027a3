"""Adam's moments kept in a lower precision between steps, updated in fp32: Megatron's
--use-precision-aware-optimizer with --exp-avg-dtype / --exp-avg-sq-dtype.

Megatron hands these dtypes to Transformer Engine's FusedAdam, which keeps each state in
its storage dtype and, every step, upcasts it to an fp32 temporary, runs the fp32 Adam
kernel on the temporaries and stores the result back:

- bf16: the fp32 value rounded to nearest (even); no scale.
- fp16: one fp32 scale per tensor, absmax / (fp16 max / 2); stored fp16(value x 1/scale)
  (0 when the scale is 0), read back as fp16 x scale. The half range left free keeps the
  next step's growth from overflowing.
- fp32: kept as is.

`StoredStates` does the same around the inner optimizer (common.build_inner_optimizer):
the fp32 update is the plain run's own kernel, so only the storage differs. With the
distributed optimizer every rank's piece of a parameter is a tensor of its own (as each
shard piece is a parameter of Megatron's FusedAdam), so fp16 scales are per piece.

During the step the temporaries take the place of the stored tensors (which are freed), so
the step's peak is the fp32 optimizer's; between steps a bf16 / fp16 state holds 2 bytes
per element instead of 4 (planning/optimizer_memory.py counts that).

Checkpoints: `saved_states` gives bf16 and fp32 states in their own dtype and fp16 ones as
their fp32 value (TE's own state_dict rule: a scale belongs to one rank's shard piece, so
it would not survive a change of layout); `restore` casts whatever a checkpoint holds to
this run's storage.
"""

from __future__ import annotations

from typing import Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_RANGE = torch.finfo(torch.float16).max / 2.0  # TE's dtype_to_range_map[fp16]


def state_dtypes(exp_avg: str, exp_avg_sq: str) -> dict[str, torch.dtype]:
    """The states stored below fp32, by Adam's state name (--exp-avg-dtype and
    --exp-avg-sq-dtype: fp32 / bf16 / fp16)."""
    wanted = {"exp_avg": DTYPES[exp_avg], "exp_avg_sq": DTYPES[exp_avg_sq]}
    return {name: dtype for name, dtype in wanted.items() if dtype != torch.float32}


def fp16_scale(x: torch.Tensor) -> torch.Tensor:
    """TE's per-tensor scale of an fp32 state: absmax / (fp16 max / 2), shape [1], on the
    device (no host read)."""
    lo, hi = torch.aminmax(x)
    absmax = torch.maximum(-lo, hi).reshape(1).float()
    return absmax / torch.full([1], FP16_RANGE, dtype=torch.float32, device=x.device)


def store(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """An fp32 state -> (its storage in `dtype`, its scale or None). Rounds to nearest."""
    if dtype != torch.float16:
        return x.to(dtype), None
    if x.numel() == 0:
        return x.to(dtype), torch.ones(1, dtype=torch.float32, device=x.device)
    scale = fp16_scale(x)
    rscale = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    return (x * rscale).to(dtype), scale


def load(stored: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Storage -> the fp32 state (a new tensor; fp32 storage itself)."""
    if stored.dtype == torch.float32:
        return stored
    value = stored.float()
    return value if scale is None else value.mul_(scale)


class StoredStates:
    """The inner optimizer with the states in `dtypes` stored in that dtype between steps
    (module doc). Looks like the inner optimizer to its callers: param_groups, state (the
    stored tensors), step, state_dict."""

    def __init__(self, inner: torch.optim.Optimizer, dtypes: dict[str, torch.dtype]) -> None:
        self.inner = inner
        self.dtypes = dtypes
        self.scales: dict[torch.Tensor, dict[str, torch.Tensor]] = {}  # fp16 states' scales

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def _params(self):
        return (p for group in self.inner.param_groups for p in group["params"])

    def unscaled(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """The fp32 value of `param`'s state `name`."""
        return load(self.inner.state[param][name], self.scales.get(param, {}).get(name))

    def _store_all(self) -> None:
        """Every fp32 state named in `dtypes` -> its storage (after a step or a load)."""
        for p in self._params():
            st = self.inner.state.get(p)
            for name, dtype in self.dtypes.items():
                if st and name in st and st[name].dtype == torch.float32:
                    st[name], scale = store(st[name], dtype)
                    if scale is not None:
                        self.scales.setdefault(p, {})[name] = scale

    @torch.no_grad()
    def step(self) -> None:
        """Upcast, the inner optimizer's fp32 step, round back (module doc)."""
        for p in self._params():
            st = self.inner.state.get(p)
            for name in self.dtypes:
                if st and name in st:
                    st[name] = self.unscaled(p, name)
        self.inner.step()
        self._store_all()

    def saved_states(self, param: torch.Tensor) -> dict:
        """`param`'s state as a checkpoint keeps it: fp16 states as their fp32 values."""
        st = dict(self.inner.state.get(param, {}))
        for name, dtype in self.dtypes.items():
            if dtype == torch.float16 and name in st:
                st[name] = self.unscaled(param, name)
        return st

    @torch.no_grad()
    def restore(self, param: torch.Tensor, states: dict) -> None:
        """Set `param`'s state from a checkpoint's (any float dtype): the named states are
        stored in this run's dtype, the others cast to the parameter's."""
        out = {}
        for name, value in states.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and name != "step":
                value = value.to(device=param.device, dtype=torch.float32)
                if name in self.dtypes:
                    value, scale = store(value, self.dtypes[name])
                    if scale is not None:
                        self.scales.setdefault(param, {})[name] = scale
            out[name] = value
        self.inner.state[param] = out

    def state_dict(self) -> dict:
        """The inner optimizer's state dict with fp16 states as their fp32 values."""
        sd = self.inner.state_dict()
        for index, p in enumerate(self._params()):
            if index in sd["state"]:
                sd["state"][index] = self.saved_states(p)
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load casts every float state to the parameter's dtype (fp32); store the
        named ones back in theirs."""
        self.inner.load_state_dict(state_dict)
        self.scales.clear()
        self._store_all()


def saved_states(optimizer, param: torch.Tensor) -> dict:
    """`param`'s optimizer state as a checkpoint keeps it (StoredStates or plain)."""
    if isinstance(optimizer, StoredStates):
        return optimizer.saved_states(param)
    return dict(optimizer.state.get(param, {}))


def restore_states(optimizer, param: torch.Tensor, states: dict) -> None:
    """Set `param`'s optimizer state from a checkpoint's tensors, cast to this run's
    storage (fp32 for a plain optimizer: a precision-aware run's bf16 states load too)."""
    if isinstance(optimizer, StoredStates):
        optimizer.restore(param, states)
        return
    optimizer.state[param] = {
        k: v.to(dtype=param.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
        and k != "step" else v for k, v in states.items()}
