"""Every MoE test starts and ends with an empty loss tracker and unit aux-loss scale."""

from __future__ import annotations

import pytest

from megamoe.moe.losses import MoELossTracker, set_aux_loss_backward_scale


@pytest.fixture(autouse=True)
def _reset_moe_loss_state():
    MoELossTracker.clear()
    set_aux_loss_backward_scale(1.0)
    yield
    MoELossTracker.clear()
    set_aux_loss_backward_scale(1.0)
