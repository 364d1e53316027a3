"""The FP8 policy: which GEMMs of a model run in FP8, and the scaling state of the run.

As Megatron with Transformer Engine: every linear inside the transformer layers (QKV,
attention output, dense MLP fc1/fc2, shared experts, MLA's projections, MTP's eh_proj) and
the routed experts' GEMMs run in FP8; the router, norms, softmax, embeddings, output
layer and the optimizer stay in the model's precision. --fp8-output-proj (MXFP8 only)
adds the output layer's GEMMs, as Megatron's TELMHeadColumnParallelLinear: its forward,
dgrad and wgrad, for the LM head and the MTP depths' heads (they call the same layer), on
the tied or untied weight the head multiplies (`output_heads`). The layers are not
changed: each gets an `fp8` GEMM (their forward calls it instead of F.linear / the grouped
GEMM), so the parameters, their names and the checkpoints are the same with and without
FP8.

`Fp8State` holds every operand's scaling. Under delayed scaling `update()` runs once per
training step, after the forward-backward pass: the current amax slots of all tensors are
max-reduced over the amax group in one all-reduce (Megatron's TP x DP x CP group, TP x CP
with --tp-only-amax-red) and each history rolls (scaling.py). TE updates after each
micro-batch; here one history slot covers the step's micro-batches (their max): the same
with one micro-batch (docs/fp8.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megamoe.config.fp8 import Fp8Config
from megamoe.model.fp8.grouped import fp8_grouped_mm
from megamoe.model.fp8.linear import LinearScaling, fp8_linear
from megamoe.model.fp8.params import Fp8Primary, primary
from megamoe.model.fp8.quantize import format_dtypes
from megamoe.model.fp8.scaling import Fp8Meta
from megamoe.model.gpt_model import GPTModel
from megamoe.model.mtp import MTPLayer
from megamoe.model.pipeline_stage import GPTStage
from megamoe.model.transformer_block import TransformerLayer
from megamoe.moe.experts import GroupedExperts
from megamoe.moe.grouped_gemm import as_group_sizes
from megamoe.moe.layer import MoELayer
from megamoe.moe.quantization_padding import quantization_alignment
from megamoe.parallel.linear import Linear
from megamoe.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

DENSE_LINEARS = (ColumnParallelLinear, RowParallelLinear, Linear)


class Fp8Gemm:
    """A dense layer's FP8 GEMM: (x, W [N, K], b) -> x @ W^T + b."""

    def __init__(self, scaling: LinearScaling) -> None:
        self.scaling = scaling

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
        prim = primary(weight)
        return fp8_linear(x, weight, bias, self.scaling,
                          None if prim is None else prim.operand())


def high_precision_layer(config: Fp8Config, layer_index: int, num_layers: int) -> bool:
    """Whether decoder layer `layer_index` (0-based, global over pipeline stages) of a
    decoder of `num_layers` runs without FP8 under --first-last-layers-bf16 (Megatron's
    is_first_last_bf16_layer: global numbers, so every stage agrees; MTP layers, numbered
    from num_layers on here, stay in FP8 as Megatron's global FP8 context runs them)."""
    if not config.first_last_layers_bf16 or not 0 <= layer_index < num_layers:
        return False
    return (layer_index < config.num_layers_at_start_in_bf16
            or layer_index >= num_layers - config.num_layers_at_end_in_bf16)


def fp8_gemm_modules(model: nn.Module, config: Optional[Fp8Config] = None,
                     num_layers: int = 0) -> list[tuple[str, nn.Module]]:
    """(name, module) of every GEMM the policy runs in FP8, in module order (the order of
    the amax buffer: the same on every rank of an amax group). With `config`, the decoder
    layers `high_precision_layer` keeps out of FP8 (--first-last-layers-bf16, of
    a decoder of `num_layers`) are left out; MTP layers never are (as Megatron)."""
    out, seen = [], set()
    for name, m in model.named_modules():
        if not isinstance(m, (TransformerLayer, MTPLayer)):
            continue
        if (config is not None and isinstance(m, TransformerLayer)
                and high_precision_layer(config, m.layer_index, num_layers)):
            continue
        for sub_name, sub in m.named_modules(prefix=name):
            if isinstance(sub, (*DENSE_LINEARS, GroupedExperts)) and id(sub) not in seen:
                seen.add(id(sub))
                out.append((sub_name, sub))
    return out


def output_heads(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module of `model` that runs the output layer (a GPTModel,
    or a last virtual pipeline stage): where --fp8-output-proj sets `output_fp8`."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, GPTModel) or (isinstance(m, GPTStage) and m.post_process)]


class Fp8State:
    """The FP8 scaling of one model: {GEMM name.operand: Fp8Meta}, the recipe's update and
    its checkpoint state."""

    def __init__(self, config: Fp8Config, group: Optional[dist.ProcessGroup] = None) -> None:
        self.config, self.group = config, group
        self.scalings: dict[str, LinearScaling] = {}

    def new_scaling(self, name: str, n: int, device: torch.device) -> LinearScaling:
        c = self.config
        fwd, bwd = format_dtypes(c.format)

        def meta(dtype):
            return Fp8Meta(c.recipe, dtype, n, history_len=c.amax_history_len,
                           compute_algo=c.amax_compute_algo, margin=c.margin, device=device)
        self.scalings[name] = LinearScaling(meta(fwd), meta(fwd), meta(bwd),
                                            fp8_wgrad=c.fp8_wgrad)
        return self.scalings[name]

    def _metas(self) -> list[tuple[str, Fp8Meta]]:
        return [(f"{name}.{op}", getattr(s, op)) for name, s in self.scalings.items()
                for op in ("x", "w", "g")]

    @torch.no_grad()
    def update(self) -> None:
        """Delayed scaling, after a step's forward-backward: reduce the current amaxes
        (max over the amax group, one all-reduce), then update every history and scale."""
        metas = [m for _, m in self._metas() if m.delayed]
        if not metas:
            return
        current = torch.cat([m.amax_history[0] for m in metas])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(current, op=dist.ReduceOp.MAX, group=self.group)
        for m, amax in zip(metas, current.split([m.n for m in metas])):
            m.amax_history[0].copy_(amax)
            m.update()

    def amax_history_bytes(self) -> int:
        return sum(m.amax_history.numel() * 4 + m.scale.numel() * 4
                   for _, m in self._metas() if m.delayed)

    def state_dict(self) -> dict:
        """Delayed scaling's amax histories and scales (snapshots), by GEMM name."""
        return {key: m.state() for key, m in self._metas() if m.delayed}

    def load_state_dict(self, state: dict, where: str = "fp8 state") -> None:
        """Load `state_dict()`; every tensor the recipe needs must be there with its
        shape (checked: a checkpoint is untrusted)."""
        if not isinstance(state, dict):
            raise ValueError(f"{where}: expected a dict of FP8 scaling states")
        mine = dict(self._metas())
        wanted = {k for k, m in mine.items() if m.delayed}
        if set(state) != wanted:
            missing, extra = sorted(wanted - set(state)), sorted(set(state) - wanted)
            raise ValueError(f"{where}: the FP8 tensors differ from this model's "
                             f"(missing {missing[:3]}, unexpected {extra[:3]})")
        for key in sorted(wanted):
            mine[key].load_state(state[key], f"{where}[{key}]")


def set_router_padding(model: nn.Module, config: Fp8Config) -> None:
    """--moe-router-padding-for-quantization: every MoE layer (those kept out of FP8 too,
    as Megatron's dispatcher pads whatever the layer's precision) pads its routing map to
    the recipe's alignment (moe/quantization_padding.py)."""
    if config.enabled and config.router_padding:
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.quantization_alignment = quantization_alignment(config.recipe)


def apply_fp8(model: nn.Module, config: Fp8Config, device: torch.device,
              group: Optional[dist.ProcessGroup] = None,
              num_layers: Optional[int] = None) -> Optional[Fp8State]:
    """Give every GEMM of `fp8_gemm_modules(model)` its FP8 GEMM under `config` (None and
    nothing changed when FP8 is off). `group`: the amax reduction group; `num_layers`: the
    whole decoder's layer count (all pipeline stages), needed by --first-last-layers-bf16."""
    if not config.enabled:
        return None
    if config.first_last_layers_bf16 and num_layers is None:
        raise ValueError("--first-last-layers-bf16 needs the decoder's num_layers")
    set_router_padding(model, config)
    state = Fp8State(config, group)
    for name, m in fp8_gemm_modules(model, config, num_layers or 0):
        if isinstance(m, GroupedExperts):
            for w in ("fc1", "fc2"):
                m_scaling = state.new_scaling(f"{name}.{w}", m.num_local_experts, device)
                setattr(m, f"fp8_{w}", m_scaling)
            m.fp8 = _ExpertsGemm(m)
        else:
            m.fp8 = Fp8Gemm(state.new_scaling(name, 1, device))
    if config.param_gather:  # the distributed optimizer quantises and holds these weights
        mark_fp8_primary(model)
    if config.output_proj:  # MXFP8 only (config/fp8.py): no delayed state to checkpoint
        for name, m in output_heads(model):
            prefix = f"{name}." if name else ""
            m.output_fp8 = Fp8Gemm(state.new_scaling(f"{prefix}output_layer", 1, device))
    model.fp8_state = state
    return state


def mark_fp8_primary(model: nn.Module) -> None:
    """--fp8-param-gather: give every weight of an FP8 GEMM (`m.fp8` set by apply_fp8) its
    Fp8Primary (model/fp8/params.py)."""
    for m in model.modules():
        gemm = getattr(m, "fp8", None)
        if isinstance(gemm, Fp8Gemm):
            pairs = [(m.weight, gemm.scaling.w, 1)]
        elif isinstance(gemm, _ExpertsGemm):
            pairs = [(m.fc1_weight, m.fp8_fc1.w, m.num_local_experts),
                     (m.fc2_weight, m.fp8_fc2.w, m.num_local_experts)]
        else:
            continue
        for p, meta, lead in pairs:
            if primary(p) is None:
                block = 128 if meta.recipe == "blockwise" else 0  # 128x128 weight blocks
                p.fp8_primary = Fp8Primary(meta, tuple(p.shape), lead, block)


class _ExpertsGemm:
    """Routes each of the experts' two GEMMs to its own scaling (fc1 or fc2 by weight)."""

    def __init__(self, experts: GroupedExperts) -> None:
        self.experts = experts

    def __call__(self, x_NK: torch.Tensor, w_EKM: torch.Tensor, sizes) -> torch.Tensor:
        e = self.experts
        scaling = e.fp8_fc1 if w_EKM is e.fc1_weight else e.fp8_fc2
        prim = primary(w_EKM)
        return fp8_grouped_mm(x_NK, w_EKM, as_group_sizes(sizes).host_list(), scaling,
                              None if prim is None else prim.operand())
