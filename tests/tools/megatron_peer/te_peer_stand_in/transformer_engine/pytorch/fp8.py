"""transformer_engine.pytorch.fp8 as megatron-core imports it: FP8 is never enabled here
(asking to enable it raises)."""

import contextlib


class FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None

    @staticmethod
    def fp8_graph_capturing() -> bool:
        return False


def _no_fp8(enabled: bool, what: str):
    if enabled:
        raise NotImplementedError(f"the peer's TE stand-in runs no FP8 ({what})")
    return contextlib.nullcontext()


def fp8_autocast(enabled: bool = True, *args, **kwargs):
    return _no_fp8(enabled, "fp8_autocast")


def fp8_model_init(enabled: bool = True, *args, **kwargs):
    return _no_fp8(enabled, "fp8_model_init")
