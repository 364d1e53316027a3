"""A CPU stand-in for NVIDIA apex, installed as a fake `apex` package inside tests only.

It reproduces what megamoe relies on from the pinned NVIDIA/apex commit
6424da3b4faa6c8f062da4a48c424fff3f02d42d:

- apex/optimizers/fused_adam.py, FusedAdam: the constructor's signature; its refusal
  without the CUDA extensions (`multi_tensor_applier.available`, set by importing `amp_C`
  in apex/multi_tensor_apply/multi_tensor_apply.py: "apex.optimizers.FusedAdam requires
  cuda extensions"); its step bookkeeping (one int per group, `group["step"]`, advanced by
  every step() of a non-empty group before the update, no per-parameter "step"; states
  exp_avg / exp_avg_sq created in fp32 when a parameter's state is empty); and the update
  of csrc/multi_tensor_adam.cu in ADAM_MODE_1 (AdamW) with bias correction from that
  group step, here in torch ops on the CPU;
- apex/normalization/fused_layer_norm.py: fused_layer_norm_affine / fused_rms_norm_affine
  import the extension `fused_layer_norm_cuda` at their first forward and die there when
  apex was built without it.

`install(monkeypatch, ...)` puts the package, and the extensions asked for, in
sys.modules (an extension not asked for is made unimportable) and resets megamoe's probe.
"""

from __future__ import annotations

import importlib
import sys
import types

import torch

import megamoe.model.apex_kernels as apex_kernels_module


class FusedAdam(torch.optim.Optimizer):
    """apex.optimizers.FusedAdam's conventions and math at the pinned commit (non-capturable
    path, fp32 parameters)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True,
                 capturable=False, master_weights=False):
        if amsgrad or capturable or master_weights:
            raise NotImplementedError("the stand-in models the plain path only")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        try:
            importlib.import_module("amp_C")
        except ImportError:
            raise RuntimeError("apex.optimizers.FusedAdam requires cuda extensions") from None

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            bc1 = 1 - beta1 ** group["step"] if group["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** group["step"] if group["bias_correction"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p).float()
                    state["exp_avg_sq"] = torch.zeros_like(p).float()
                self._update(p, p.grad.float(), state, group, bc1, bc2)
        return loss

    def _update(self, p, g, state, group, bc1, bc2) -> None:
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if not self.adam_w_mode:  # ADAM_MODE_0: L2 into the gradient
            g = g + group["weight_decay"] * p
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
        if self.adam_w_mode:
            update = update + group["weight_decay"] * p
        p.sub_(group["lr"] * update)


FusedAdam.__module__ = "apex.optimizers.fused_adam"  # where apex defines it


def _fused_layer_norm_affine(x, weight, bias, normalized_shape, eps, memory_efficient=False):
    ext = importlib.import_module("fused_layer_norm_cuda")  # as apex: at the first forward
    return ext.forward_affine(x, normalized_shape, weight, bias, eps)[0]


def _fused_rms_norm_affine(x, weight, normalized_shape, eps, memory_efficient=False):
    ext = importlib.import_module("fused_layer_norm_cuda")
    return ext.rms_forward_affine(x, normalized_shape, weight, eps)[0]


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def install(monkeypatch, *, adam_extension: bool = True, norm_extension: bool = True,
            calls: list | None = None) -> None:
    """Fake `apex` (+ `amp_C`, `fused_layer_norm_cuda` when asked) for this test; the
    extension kernels record their calls in `calls` and run torch's math."""
    calls = [] if calls is None else calls

    def forward_affine(x, shape, w, b, eps):
        calls.append(("ln", tuple(shape), eps))
        return torch.nn.functional.layer_norm(x, shape, w, b, eps), None, None

    def rms_forward_affine(x, shape, w, eps):
        calls.append(("rms", tuple(shape), eps))
        return torch.nn.functional.rms_norm(x, shape, w, eps), None

    norm = _module("apex.normalization.fused_layer_norm",
                   fused_layer_norm_affine=_fused_layer_norm_affine,
                   fused_rms_norm_affine=_fused_rms_norm_affine)
    modules = {
        "apex": _module("apex"),
        "apex.optimizers": _module("apex.optimizers", FusedAdam=FusedAdam),
        "apex.normalization": _module("apex.normalization", fused_layer_norm=norm),
        "apex.normalization.fused_layer_norm": norm,
        "amp_C": _module("amp_C", multi_tensor_adam=None, multi_tensor_adam_capturable=None,
                         multi_tensor_adam_capturable_master=None) if adam_extension else None,
        "fused_layer_norm_cuda": _module(
            "fused_layer_norm_cuda", forward_affine=forward_affine,
            rms_forward_affine=rms_forward_affine) if norm_extension else None,
    }
    for name, module in modules.items():  # None in sys.modules: "import name" fails
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(apex_kernels_module, "_PROBED", None)
