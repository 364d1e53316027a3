"""How a config field declares where its value comes from, and the one error type of
config validation.

Every field that a Megatron flag sets declares that flag once, in its metadata
(`flag("--num-layers", default=2)`); the command line maps flags to fields by reading
it (megamoe/cli/mapping.py), and validation messages name the flag, so a library user and
a launch script get the same sentence. Fields no flag sets say where their value comes from
(`derived("the tokenizer's vocabulary")`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


class ConfigError(ValueError):
    """An invalid configuration; the message names the flag(s) involved."""


def flag(name: str, default: Any = dataclasses.MISSING, *,
         default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
         dest: str | None = None) -> Any:
    """A field set by the Megatron-style flag `name`; `dest` is the parsed attribute when
    it is not the flag's name (`--disable-bias-linear` stores `add_bias_linear`)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"flag": name, "dest": dest or flag_dest(name)})


def derived(source: str, default: Any = dataclasses.MISSING, *,
            default_factory: Callable[[], Any] | Any = dataclasses.MISSING) -> Any:
    """A field no flag sets directly: `source` says where its value comes from."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"derived": source})


def flag_name(config: Any, field_name: str) -> str:
    """The flag that sets `field_name` of `config` (for messages), else the field name."""
    for f in dataclasses.fields(config):
        if f.name == field_name:
            return f.metadata.get("flag", field_name)
    raise KeyError(f"{type(config).__name__} has no field {field_name!r}")


def flag_dest(name: str) -> str:
    """argparse's attribute for a flag: '--moe-router-topk' -> 'moe_router_topk'."""
    return name.lstrip("-").replace("-", "_")


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless `condition`."""
    if not condition:
        raise ConfigError(message)


def check_positive(config: Any, *names: str, allow_zero: bool = False) -> None:
    """Each named field is > 0 (>= 0 with `allow_zero`), or None."""
    for name in names:
        value = getattr(config, name)
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            bound = ">= 0" if allow_zero else "positive"
            raise ConfigError(f"{flag_name(config, name)} must be {bound}, got {value}")


def check_range(config: Any, name: str, low: float, high: Optional[float] = None, *,
                low_open: bool = False, high_open: bool = True) -> None:
    """The named field lies in [low, high) (brackets per `low_open` / `high_open`; no upper
    bound when `high` is None), or is None."""
    value = getattr(config, name)
    if value is None:
        return
    above = value > low if low_open else value >= low
    below = high is None or (value < high if high_open else value <= high)
    if not (above and below):
        if high is None:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
        else:
            bound = (f"in {'(' if low_open else '['}{low:g}, {high:g}"
                     f"{')' if high_open else ']'}")
        raise ConfigError(f"{flag_name(config, name)} must be {bound}, got {value}")


def to_dict(obj: Any) -> dict:
    """Dataclass (nested) -> plain dict, for checkpoints and logs."""
    return dataclasses.asdict(obj)


def known_fields(cls: type, values: dict) -> dict:
    """Only the entries of `values` that are fields of `cls` (a stored config may come
    from an older or newer megamoe)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}
