"""Transformer Engine's per-module checkpoint extra state (`_extra_state`), by module name.

Every TE module carries an extra state (TE's `get_extra_state`: a 1-D uint8 CPU tensor, empty
for stateless recipes, else TE's pickled FP8 metadata: delayed scaling's scales and amax
histories). Megatron writes it as `<module>._extra_state` beside the parameters. megamoe's
TE modules sit outside the model's module tree (engine.py), so the model's state dict
stays megamoe's; their extra states are collected here, keyed by Megatron's TE-spec module
names within this rank's model (`decoder.layers.3.self_attention.linear_qkv`,
`...mlp.experts.linear_fc1`; a pipeline stage's own prefix under PP), and saved in the
checkpoint's common state (training/checkpoint/te_state.py). A checkpoint
without them (a local run's) leaves TE's initial state, as Megatron loading a checkpoint
without `_extra_state`.
"""

from __future__ import annotations

import torch
from torch import nn

MAX_EXTRA_STATE_BYTES = 1 << 26  # TE's state is scales and histories: far below 64 MiB


class TeExtraState:
    """{Megatron TE-spec module name: TE module} of one model; `state_dict()` snapshots
    their extra states, `load_state_dict()` checks and restores them."""

    def __init__(self) -> None:
        self.modules: dict[str, nn.Module] = {}

    def add(self, name: str, module: nn.Module) -> None:
        if name in self.modules:
            raise ValueError(f"two Transformer Engine modules named {name}")
        self.modules[name] = module

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Host copies (a snapshot: TE's later updates do not reach a pending save)."""
        out = {}
        for name, module in self.modules.items():
            state = module.get_extra_state()
            out[name] = state.detach().to("cpu", copy=True) if isinstance(state, torch.Tensor) \
                else _bad(name, "get_extra_state() did not return a tensor")
        return out

    def load_state_dict(self, state: dict, where: str = "te_extra_state") -> None:
        """Restore `state_dict()`: the same module names, each a 1-D uint8 tensor of at
        most MAX_EXTRA_STATE_BYTES (a checkpoint is untrusted; TE checks the payload)."""
        if not isinstance(state, dict):
            raise ValueError(f"{where}: expected a dict of Transformer Engine extra states")
        if set(state) != set(self.modules):
            missing = sorted(set(self.modules) - set(state))
            extra = sorted(set(state) - set(self.modules))
            raise ValueError(f"{where}: the Transformer Engine modules differ from this "
                             f"model's (missing {missing[:3]}, unexpected {extra[:3]})")
        for name in sorted(state):
            t = state[name]
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 \
                    or t.numel() > MAX_EXTRA_STATE_BYTES:
                raise ValueError(f"{where}[{name}]: expected a 1-D uint8 tensor of at most "
                                 f"{MAX_EXTRA_STATE_BYTES} bytes")
        for name in sorted(state):
            self.modules[name].set_extra_state(state[name].to("cpu"))


def _bad(name: str, why: str):
    raise RuntimeError(f"Transformer Engine module {name}: {why}")
