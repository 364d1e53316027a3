"""transformer_engine.pytorch.router: megatron-core >= TE 2.7 imports these three at
import; they run only with --moe-router-fusion, which the peer does not use."""


def _fused(*args, **kwargs):
    raise NotImplementedError("the peer's TE stand-in has no fused router kernels")


fused_topk_with_score_function = _fused
fused_compute_score_for_moe_aux_loss = _fused
fused_moe_aux_loss = _fused
