"""apex is used only when its CUDA extensions load (tests/apex_stand_in.py fakes the
package as NVIDIA/apex 6424da3b builds it, with or without the extensions); otherwise the
torch kernels run and one line says why. A fake CUDA flag routes the norms (the probe
runs on GPU paths only)."""

from __future__ import annotations

import pytest
import torch

from megamoe.config import OptimizerConfig
from megamoe.model import norms
from megamoe.model.apex_kernels import apex_kernels
from megamoe.training.optim import build_optimizer, common
from tests import apex_stand_in


def _run_gpu_paths(monkeypatch):
    """A norm forward of each kind on a "CUDA" tensor and the optimizer of GPU parameters."""
    x = torch.randn(3, 8)
    want = (torch.nn.functional.rms_norm(x, (8,), torch.ones(8), 1e-6),
            torch.nn.functional.layer_norm(x, (8,), eps=1e-5))
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        got = (norms.RMSNorm(8, eps=1e-6)(x), norms.LayerNorm(8, eps=1e-5)(x))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    monkeypatch.setattr(common, "_on_gpu", lambda groups: True)
    return build_optimizer(torch.nn.Linear(4, 3), OptimizerConfig(lr=1e-2)).optimizer


@pytest.mark.parametrize("adam_ext,norm_ext", [(False, False), (True, False), (False, True)],
                         ids=["no-extensions", "no-norm-extension", "no-adam-extension"])
def test_apex_without_its_cuda_extensions_falls_back_to_torch(monkeypatch, capsys, adam_ext,
                                                              norm_ext):
    calls = []
    apex_stand_in.install(monkeypatch, adam_extension=adam_ext, norm_extension=norm_ext,
                          calls=calls)
    inner = _run_gpu_paths(monkeypatch)
    assert isinstance(inner, apex_stand_in.FusedAdam) == adam_ext
    assert (calls == [("rms", (8,), 1e-6), ("ln", (8,), 1e-5)]) == norm_ext
    _run_gpu_paths(monkeypatch)  # probed once: no second line
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("megamoe: warning: torch's kernels run "
                                                   "instead of NVIDIA apex's"), lines
    for ext, present in (("amp_C", adam_ext), ("fused_layer_norm_cuda", norm_ext)):
        assert (f"{ext} does not import" in lines[0]) != present, lines[0]


def test_apex_with_its_extensions_runs_its_kernels_silently(monkeypatch, capsys):
    calls = []
    apex_stand_in.install(monkeypatch, calls=calls)
    assert isinstance(_run_gpu_paths(monkeypatch), apex_stand_in.FusedAdam)
    assert calls == [("rms", (8,), 1e-6), ("ln", (8,), 1e-5)]
    assert capsys.readouterr().err == "" and apex_kernels().problems == ()


def test_cpu_paths_never_probe_apex(monkeypatch):
    """A CPU run neither imports apex nor warns about it."""
    apex_stand_in.install(monkeypatch, adam_extension=False, norm_extension=False)
    x = torch.randn(2, 8)
    norms.RMSNorm(8)(x)
    norms.LayerNorm(8)(x)
    assert isinstance(build_optimizer(torch.nn.Linear(4, 3), OptimizerConfig()).optimizer,
                      torch.optim.AdamW)
    from megamoe.model import apex_kernels as probe_module
    assert probe_module._PROBED is None
