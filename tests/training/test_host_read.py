"""training/host_read.py: every logged tensor comes back in one copy, with its value."""

from __future__ import annotations

import numpy as np
import torch

from megamoe.training.host_read import read_all
from tests.moe.test_host_syncs import HostSyncCounter


def test_one_copy_for_all_values_exactly():
    loss = torch.tensor(4.5678901, dtype=torch.float32)
    shared = torch.tensor(0.1, dtype=torch.float64)
    counts = torch.tensor([[3, 0, 2**40], [1, 1, 1]])  # int64 counts [layers, experts]
    a = {"lm loss": loss, "grad norm": 0.75, "moe/x": shared}
    b = {"routed": counts, "moe/x": shared, "num zeros": torch.tensor(2688)}
    with HostSyncCounter() as c:
        read_all([a, b, {}])
    assert c.by_op == {"tolist": 1}, c
    assert a == {"lm loss": float(np.float32(4.5678901)), "grad norm": 0.75, "moe/x": 0.1}
    assert type(a["lm loss"]) is float and b["num zeros"] == 2688.0
    np.testing.assert_array_equal(b["routed"], [[3, 0, 2**40], [1, 1, 1]])
    assert b["routed"].shape == (2, 3) and b["moe/x"] == 0.1
    with HostSyncCounter() as again:
        read_all([a, b])  # already host values: nothing to read
    assert again.total == 0


def test_a_step_reports_only_its_own_moe_and_mtp_losses():
    """Losses a forward outside the step left in the trackers (another run or a caller's
    forward in this process) are not the step's: train_step clears them first."""
    from megamoe.model.mtp import MTPLossTracker
    from megamoe.moe.losses import MoELossTracker
    from megamoe.training.loop import train_step
    from tests.training.test_nan_check import _batches, _components

    reported = []
    for leftover in (False, True):
        run, mesh, model, optimizer, scheduler = _components("")
        if leftover:
            MoELossTracker.record("load_balancing_loss", 0, 2, torch.tensor(5.0))
            MTPLossTracker.take()
        reported.append(train_step(run, mesh, model, optimizer, scheduler, _batches(0), 1))
    assert reported[0]["load_balancing_loss"] == reported[1]["load_balancing_loss"]
    assert reported[0]["lm loss"] == reported[1]["lm loss"]
