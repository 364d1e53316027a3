"""Once-per-global-batch hooks of the MoE routers, called by the training schedule/loop.

- `start_global_batch(model)`: before the first micro-batch; restarts the running token
  counts of global_aux_loss.
- `update_expert_biases(model, group)`: after the optimizer step; aux-loss-free balancing
  bias update from the token counts of the whole global batch (all-reduced over `group`,
  the tp-dp-cp group; None = this process only).

Both walk the model, so the schedule needs no knowledge of where MoE layers are.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megamoe.moe.router import TopKRouter


def _routers(model: torch.nn.Module) -> list[TopKRouter]:
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def start_global_batch(model: torch.nn.Module) -> None:
    for router in _routers(model):
        router.reset_global_batch_state()


def update_expert_biases(model: torch.nn.Module,
                         process_group: Optional[dist.ProcessGroup] = None) -> None:
    for router in _routers(model):
        router.update_expert_bias(process_group)
