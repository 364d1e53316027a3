"""The recipe classes megatron-core names (TEDelayedScaling subclasses DelayedScaling at
import); constructing one raises: the peer's stand-in runs no FP8."""

from enum import Enum


class Format(Enum):
    E4M3 = "E4M3"
    HYBRID = "HYBRID"


class Recipe:
    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"the peer's TE stand-in runs no FP8 ({type(self).__name__})")


class DelayedScaling(Recipe):
    pass


class Float8CurrentScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass


class MXFP8BlockScaling(Recipe):
    pass


class NVFP4BlockScaling(Recipe):
    pass
