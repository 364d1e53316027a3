"""Stand-in for transformer_engine.common.recipe: Format and the FP8 recipe classes, each
constructor checked against TE's recorded dataclass fields."""

from __future__ import annotations

from enum import Enum

from transformer_engine import checked


class Format(Enum):
    """TE's recipe.Format members (values: (forward, backward) dtypes' names)."""
    E2M1 = ("e2m1", "e2m1")
    E4M3 = ("e4m3", "e4m3")
    E5M2 = ("e5m2", "e5m2")
    HYBRID = ("e4m3", "e5m2")


class Recipe:
    _key = ""

    def __init__(self, *args, **kwargs) -> None:
        self.fields = checked(f"common.recipe.{type(self).__name__}.__init__", args, kwargs)
        for name, value in self.fields.items():
            setattr(self, name, value)
        if self.fields.get("fp8_format") is None:
            self.fp8_format = Format.HYBRID  # TE's default (a default_factory-free field)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fields})"


class DelayedScaling(Recipe):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name, default in (("margin", 0), ("amax_history_len", 1024),
                              ("amax_compute_algo", "max")):
            if getattr(self, name) is None:
                setattr(self, name, default)


class Float8CurrentScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass


class MXFP8BlockScaling(Recipe):
    pass
