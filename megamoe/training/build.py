"""The model of a run, as this rank holds it: built as one process builds it (with the
seed), upcycled from the dense MLP when asked, then parallelized for the layout."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from megamoe.config import RunConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.model.moefy import upcycle_model
from megamoe.parallel.mesh import Mesh, single_process_mesh
from megamoe.parallelize import parallelize


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(run: RunConfig, mesh: Mesh | None = None) -> torch.nn.Module:
    """Weights depend on the seed and the config only: every shard is a slice of them."""
    set_seed(run.train.seed)
    model = GPTModel(run.model)
    if run.model.moe is not None and run.moe_training.use_upcycling:
        # --moe-use-upcycling: every expert starts as this seed's dense MLP (moefy.py).
        set_seed(run.train.seed)
        dense_config = dataclasses.replace(run.model, moe=None, moe_layer_pattern=None)
        upcycle_model(GPTModel(dense_config), model)
    dtype = torch.bfloat16 if run.optim.bf16 else torch.float32
    return parallelize(model, mesh or single_process_mesh(), run.parallel, run.moe_execution,
                       seed=run.train.seed, dtype=dtype)
