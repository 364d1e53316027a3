"""Stand-in for transformer_engine.pytorch (see the package docstring): Linear,
LayerNormLinear, LayerNormMLP, GroupedLinear, DotProductAttention, RMSNorm, LayerNorm,
autocast and fp8_autocast, with TE's recorded signatures and megamoe's fp32 math."""

from __future__ import annotations

import pickle
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformer_engine import checked
from transformer_engine.common.recipe import DelayedScaling, Recipe

# The innermost active autocast: (enabled, recipe, amax reduction group); and every call of
# a module, (module class name, recipe or None), for the tests to read.
_ACTIVE: list[tuple[bool, object, object]] = []
CALLS: list[tuple[str, object]] = []


class autocast:  # noqa: N801 - TE's name
    def __init__(self, *args, **kwargs) -> None:
        b = checked("pytorch.autocast.__init__", args, kwargs)
        if b["recipe"] is not None and not isinstance(b["recipe"], Recipe):
            raise TypeError("recipe must be a transformer_engine.common.recipe.Recipe")
        self.state = (bool(b["enabled"]), b["recipe"], b["amax_reduction_group"])

    def __enter__(self):
        _ACTIVE.append(self.state)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.pop()


def fp8_autocast(*args, **kwargs):
    b = checked("pytorch.fp8_autocast", args, kwargs)
    warnings.warn("fp8_autocast is deprecated", DeprecationWarning, stacklevel=2)
    return autocast(enabled=b["enabled"], calibrating=b["calibrating"],
                    recipe=b["fp8_recipe"], amax_reduction_group=b["fp8_group"])


def _current_recipe():
    return _ACTIVE[-1][1] if _ACTIVE and _ACTIVE[-1][0] else None


class _Module(nn.Module):
    """TE's base-module conventions: the FP8 bookkeeping and its extra state."""

    def _start(self, key: str, args: tuple, kwargs: dict) -> dict:
        nn.Module.__init__(self)
        b = checked(key, args, kwargs)
        self.params_dtype = b.get("params_dtype") or torch.get_default_dtype()
        self.te_device = b.get("device") or "cuda"
        self.fp8_state: dict = {}
        return b

    def _param(self, name: str, *shape: int, init=None) -> None:
        p = nn.Parameter(torch.empty(*shape, dtype=self.params_dtype, device=self.te_device))
        with torch.no_grad():
            (init or nn.init.zeros_)(p)
        self.register_parameter(name, p)

    def _record(self, *inputs: torch.Tensor) -> None:
        recipe = _current_recipe()
        CALLS.append((type(self).__name__, recipe))
        if isinstance(recipe, DelayedScaling) and torch.is_grad_enabled():
            amax = torch.stack([t.detach().abs().amax().float().cpu() for t in inputs])
            hist = self.fp8_state.get("amax_history")
            if hist is None or hist.shape[0] != recipe.amax_history_len:
                hist = torch.zeros(recipe.amax_history_len, len(inputs))
            self.fp8_state = {"amax_history": torch.cat([hist[1:], amax[None]]),
                              "steps": self.fp8_state.get("steps", 0) + 1}

    def get_extra_state(self) -> torch.Tensor:
        if not self.fp8_state:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(pickle.dumps(self.fp8_state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None:
            return
        if not isinstance(state, torch.Tensor):
            raise RuntimeError("Unsupported checkpoint format.")
        if state.numel():
            self.fp8_state = pickle.loads(state.numpy().tobytes())


class Linear(_Module):
    def __init__(self, *args, **kwargs) -> None:
        b = self._start("pytorch.Linear.__init__", args, kwargs)
        self._param("weight", b["out_features"], b["in_features"], init=b["init_method"])
        self.use_bias = b["bias"]
        if self.use_bias:
            self._param("bias", b["out_features"])

    def forward(self, *args, **kwargs) -> torch.Tensor:
        inp = checked("pytorch.Linear.forward", args, kwargs)["inp"]
        self._record(inp)
        return F.linear(inp, self.weight, self.bias if self.use_bias else None)


def _norm(kind: str, x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    if kind == "RMSNorm":
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.layer_norm(x, weight.shape, weight, bias, eps)


class LayerNormLinear(_Module):
    def __init__(self, *args, **kwargs) -> None:
        b = self._start("pytorch.LayerNormLinear.__init__", args, kwargs)
        if b["normalization"] not in ("LayerNorm", "RMSNorm"):
            raise AssertionError("Unsupported normalization type!")
        if b["zero_centered_gamma"]:
            raise NotImplementedError("the stand-in models zero_centered_gamma=False")
        self.normalization, self.eps, self.use_bias = b["normalization"], b["eps"], b["bias"]
        self._param("layer_norm_weight", b["in_features"], init=nn.init.ones_)
        if self.normalization == "LayerNorm":
            self._param("layer_norm_bias", b["in_features"])
        self._param("weight", b["out_features"], b["in_features"], init=b["init_method"])
        if self.use_bias:
            self._param("bias", b["out_features"])

    def forward(self, *args, **kwargs) -> torch.Tensor:
        inp = checked("pytorch.LayerNormLinear.forward", args, kwargs)["inp"]
        self._record(inp)
        y = _norm(self.normalization, inp, self.layer_norm_weight,
                  getattr(self, "layer_norm_bias", None), self.eps)
        return F.linear(y, self.weight, self.bias if self.use_bias else None)


class LayerNormMLP(_Module):
    def __init__(self, *args, **kwargs) -> None:
        self._start("pytorch.LayerNormMLP.__init__", args, kwargs)
        raise NotImplementedError("the stand-in does not model LayerNormMLP (megamoe uses "
                                  "LayerNormLinear + Linear, as Megatron's TE spec)")


class GroupedLinear(_Module):
    def __init__(self, *args, **kwargs) -> None:
        b = self._start("pytorch.GroupedLinear.__init__", args, kwargs)
        self.num_gemms, self.use_bias = b["num_gemms"], b["bias"]
        for i in range(self.num_gemms):
            self._param(f"weight{i}", b["out_features"], b["in_features"], init=b["init_method"])
            if self.use_bias:
                self._param(f"bias{i}", b["out_features"])

    def forward(self, *args, **kwargs) -> torch.Tensor:
        b = checked("pytorch.GroupedLinear.forward", args, kwargs)
        inp, m_splits = b["inp"], list(b["m_splits"])
        if len(m_splits) != self.num_gemms or sum(m_splits) != inp.shape[0]:
            raise ValueError("m_splits must give one row count per GEMM, adding up to the rows")
        self._record(inp)
        outs = [F.linear(x, getattr(self, f"weight{i}"),
                         getattr(self, f"bias{i}") if self.use_bias else None)
                for i, x in enumerate(inp.split(m_splits))]
        return torch.cat(outs)


class DotProductAttention(_Module):
    def __init__(self, *args, **kwargs) -> None:
        b = self._start("pytorch.DotProductAttention.__init__", args, kwargs)
        self.heads = b["num_attention_heads"]
        self.groups = b["num_gqa_groups"] or self.heads
        kv = b["kv_channels"]  # TE: an int, or (k head dim, v head dim) (MLA)
        self.dim_k, self.dim_v = (kv, kv) if isinstance(kv, int) else tuple(kv)
        self.dropout, self.scale = b["attention_dropout"], b["softmax_scale"]
        if self.scale is None:  # TE's default: 1/sqrt(the k head dim)
            self.scale = self.dim_k ** -0.5
        self.qkv_format, self.mask_type = b["qkv_format"], b["attn_mask_type"]
        if self.qkv_format != "sbhd" or self.mask_type != "causal":
            raise NotImplementedError("the stand-in models sbhd + causal only")

    def forward(self, *args, **kwargs) -> torch.Tensor:
        b = checked("pytorch.DotProductAttention.forward", args, kwargs)
        q, k, v = b["query_layer"], b["key_layer"], b["value_layer"]
        s, bsz, n, _ = q.shape
        if n != self.heads or k.shape[2] != self.groups or v.shape[2] != self.groups:
            raise ValueError("head counts differ from the constructor's")
        # TE's forward asserts the head dims against kv_channels (dot_product_attention.py)
        assert q.shape[-1] == k.shape[-1] == self.dim_k, "Keys have another head_dim!"
        assert v.shape[-1] == self.dim_v, "Values have another head_dim!"
        self._record(q, k, v)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale, enable_gqa=k.shape[1] != q.shape[1])
        return o.permute(2, 0, 1, 3).reshape(s, bsz, n * self.dim_v)


class RMSNorm(_Module):
    def __init__(self, *args, **kwargs) -> None:
        b = self._start("pytorch.RMSNorm.__init__", args, kwargs)
        self.eps = b["eps"]
        self._param("weight", b["normalized_shape"], init=nn.init.ones_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LayerNorm(RMSNorm):
    def __init__(self, *args, **kwargs) -> None:
        b = self._start("pytorch.LayerNorm.__init__", args, kwargs)
        self.eps = b["eps"]
        self._param("weight", b["normalized_shape"], init=nn.init.ones_)
        self._param("bias", b["normalized_shape"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
