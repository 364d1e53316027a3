"""The model of a run, as this rank holds it.

Built on the meta device as one process would build it (no memory, no random draws), then
`parallelize` turns it into this rank's part (still meta), then `materialize` gives only
that part its values, on the rank's device: every value depends on --seed and its
position in the single-process model only (training/materialize.py), so every layout
trains the same model. Upcycling (--moe-use-upcycling, TP = 1 only) copies the dense MLP
into the experts before parallelizing, so it builds the single-process model on the host.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

import numpy as np
import torch

from megamoe.config import RunConfig
from megamoe.model.fp8.policy import apply_fp8
from megamoe.model.gpt_model import GPTModel
from megamoe.model.moefy import upcycle_model
from megamoe.model.te.apply import apply_transformer_engine
from megamoe.parallel.mesh import Mesh, single_process_mesh
from megamoe.parallelize import parallelize
from megamoe.training.materialize import materialize


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(run: RunConfig, mesh: Optional[Mesh] = None) -> torch.nn.Module:
    """This rank's model of `run` on `mesh.device` (one process: default_device())."""
    mesh = mesh or single_process_mesh()
    seed = run.train.seed
    dtype = torch.bfloat16 if run.optim.bf16 else torch.float16 if run.optim.fp16 \
        else torch.float32
    set_seed(seed)
    if run.model.moe is not None and run.moe_training.use_upcycling:
        model = parallelize(_upcycled(run), mesh, run.parallel, run.moe_execution,
                            seed=seed, dtype=dtype, recompute=run.recompute,
                            compile_layers=run.train.compile)
        return _with_precision(model.to(mesh.device), run, mesh)
    with torch.device("meta"):
        model = GPTModel(run.model)
    model = parallelize(model, mesh, run.parallel, run.moe_execution, seed=seed, dtype=dtype,
                        recompute=run.recompute, compile_layers=run.train.compile)
    model = materialize(model, mesh, seed, on_host=run.parallel.use_cpu_initialization)
    return _with_precision(model, run, mesh)


def _with_precision(model: torch.nn.Module, run: RunConfig, mesh: Mesh) -> torch.nn.Module:
    """--fp8-format: the transformer layers' GEMMs in FP8 (model/fp8/policy.py), or with
    --transformer-impl transformer_engine TE's modules under TE's recipe (model/te/);
    delayed scaling's amaxes are reduced over TP x DP x CP (TP x CP with
    --tp-only-amax-red), as Megatron's get_amax_reduction_group(with_context_parallel=True)."""
    group = mesh.group("tp_cp" if run.fp8.tp_only_amax_red else "tp_dp_cp")
    if run.model.transformer_impl == "transformer_engine":
        apply_transformer_engine(model, run.fp8, group,
                                 attention_backend=run.model.attention_backend,
                                 use_flash_attn=run.model.use_flash_attn,
                                 num_layers=run.model.num_layers)
    else:
        apply_fp8(model, run.fp8, mesh.device, group, num_layers=run.model.num_layers)
    return model


def _upcycled(run: RunConfig) -> torch.nn.Module:
    """The single-process MoE model (host memory) whose experts start as the dense MLP
    of the same seed (model/moefy.py); every other weight is the plain model's."""
    host = single_process_mesh(torch.device("cpu"))
    dense_config = dataclasses.replace(run.model, moe=None, moe_layer_pattern=None)
    with torch.device("meta"):
        dense, model = GPTModel(dense_config), GPTModel(run.model)
    materialize(dense, host, run.train.seed)
    materialize(model, host, run.train.seed)
    upcycle_model(dense, model)
    return model
