"""Stand-in for transformer_engine.common: the FP8 recipes' names (see the package)."""

from transformer_engine.common import recipe  # noqa: F401
