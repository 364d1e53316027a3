"""The optimizer of a run: the plain fp32-main one, or the distributed one (ZeRO-1), with
gradient reduction and norm wired to the mesh's groups, optionally overlapped with the
backward and the forward (overlap.py)."""

from __future__ import annotations

from typing import Optional

import torch

from megamoe.config import OptimizerConfig
from megamoe.model.fp8.params import primary
from megamoe.parallel.mesh import Mesh
from megamoe.training.optim.distributed import DistributedOptimizer
from megamoe.training.optim.grads import model_parallel_grad_norm, reduce_gradients
from megamoe.training.optim.mixed_precision import MixedPrecisionOptimizer, ReduceGradsFn
from megamoe.training.optim.overlap import OverlapOptions


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig,
                    reduce_grads_fn: Optional[ReduceGradsFn] = None,
                    mesh: Optional[Mesh] = None, distributed: bool = False,
                    overlap: Optional[OverlapOptions] = None):
    """With a `mesh` (and no explicit `reduce_grads_fn`), gradients are reduced over its TP,
    DP x CP (dense parameters: every cp rank holds them whole and saw part of each
    sequence, as Megatron's dp_cp) and EDP (which folds cp in) groups and the grad norm
    counts every parameter once across TP, EP and PP. `distributed`
    (--use-distributed-optimizer) shards main params and states over DP x CP / EDP
    (distributed.py), as Megatron's; with one rank in both it is this same optimizer. `overlap`
    (--overlap-grad-reduce, with a mesh) reduces the data-parallel gradients in buckets
    launched from the backward; its `param_gather` needs the distributed optimizer."""
    if mesh is None or reduce_grads_fn is not None:
        overlap = None
    # FP8 primary weights (--fp8-param-gather) live in the distributed optimizer's
    # buffers, with one rank too
    fp8_primary = any(primary(p) is not None for p in model.parameters())
    if distributed and mesh is not None and reduce_grads_fn is None and (
            mesh.dp_size * mesh.cp_size > 1 or mesh.edp_size > 1 or fp8_primary):
        return DistributedOptimizer(
            model, config, tp_group=mesh.group("tp"), dp_group=_dense_dp(mesh),
            pp_group=mesh.group("pp"), embd_group=mesh.group("embd"),
            ep_group=mesh.group("ep"), edp_group=mesh.group("edp"),
            etp_group=mesh.group("etp"), overlap=overlap)
    if overlap is not None and overlap.param_gather:  # one rank per shard: nothing to gather
        overlap = OverlapOptions(overlap.bucket_size, overlap.check_nan)
    opt = MixedPrecisionOptimizer(
        model, config, reduce_grads_fn, overlap=overlap,
        dp_group=None if mesh is None else _dense_dp(mesh),
        edp_group=None if mesh is None else mesh.group("edp"),
        use_distributed_optimizer=distributed)
    if mesh is not None and reduce_grads_fn is None:
        params = opt.model_params  # aligned with the grads the hooks receive
        tp, pp = mesh.group("tp"), mesh.group("pp")
        # with overlap the data-parallel part already ran in the buckets
        dp, edp = (None, None) if overlap is not None else (_dense_dp(mesh),
                                                            mesh.group("edp"))
        embd, ep, etp = mesh.group("embd"), mesh.group("ep"), mesh.group("etp")
        opt.model_parallel_groups = (tp, pp, ep, etp)
        opt.single_rank = mesh.world_size == 1
        opt.agree_found_inf = mesh.world_size > 1
        opt.reduce_grads_fn = lambda grads: reduce_gradients(grads, params, tp, dp,
                                                             embd_group=embd, edp_group=edp)
        if tp is not None or pp is not None or ep is not None:
            opt.grad_norm_fn = lambda grads: model_parallel_grad_norm(grads, params, tp, pp,
                                                                      ep, etp)
    return opt


def _dense_dp(mesh: Mesh):
    """The group dense gradients reduce and shard over: dp x cp (every cp rank holds the
    dense parameters whole and saw part of each sequence); the dp group itself without
    CP (same ranks, and the name timeout messages give)."""
    return mesh.group("dp_cp") if mesh.cp_size > 1 else mesh.group("dp")
