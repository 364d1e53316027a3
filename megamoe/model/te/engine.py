"""What every TE engine shares: a TE module that computes with a megamoe layer's own
parameters.

An engine holds its TE module outside the model's module tree. The TE module's
parameters are replaced, after construction, by the very `nn.Parameter` objects of the
megamoe layer (`share`), so the model has one set of parameters whichever implementation
runs: the optimizer, gradient reduction, parameter marks (TP / expert / sequence-parallel)
and every checkpoint format see megamoe's names and layouts, and a checkpoint moves
between `local` and `transformer_engine` runs unchanged. (Registering the TE module in the
tree would list each parameter twice in state dicts, under both names.) Because the
module is outside the tree, `model.train()` / `eval()` does not reach it: each call copies
the owner's mode first (`sync_mode`).

TE's own initialisation is skipped (`init_method=no_init`): the values are the layer's,
and a draw would shift the random streams (dropout) against a local run.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def no_init(weight: torch.Tensor) -> None:
    """TE's `init_method`: leave the (soon replaced) tensor as allocated, draw nothing."""
    del weight


def share(te_module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
    """Make `te_module.<name>` the megamoe parameter `param` itself (None: leave it)."""
    if param is not None:
        te_module.register_parameter(name, param)


class Engine:
    """A TE module running a megamoe layer's computation (`owner`: that layer)."""

    def __init__(self, module: nn.Module, owner: nn.Module) -> None:
        self.module = module
        self.owner = owner

    def sync_mode(self) -> None:
        if self.module.training != self.owner.training:
            self.module.train(self.owner.training)

    def check_same(self, name: str, param: Optional[torch.Tensor]) -> None:
        """The layer hands its parameter to the engine at every call: it must still be the
        one the TE module computes with (a layer re-sharded or re-materialised after the
        engine was installed would otherwise train a stale copy)."""
        if param is not None and getattr(self.module, name) is not param:
            raise RuntimeError(f"{type(self.owner).__name__}.{name} was replaced after "
                               "Transformer Engine's module was installed on it")
