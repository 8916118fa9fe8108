"""The layers of a run's configuration resolved into one `Config`, once: a pure function of data.

The layers, lowest first: Config's defaults < the task's recipe (`Task.flag_defaults`) < `--preset` < the
`--config` file < the command line (or `twophase.fit`'s Config, in the file's place, with the command line's
rank); `--resume` takes the checkpoint's configuration in place of the recipe and the preset, `--init-from` its
model flags over its task's recipe. Each layer holds only what it sets; a value set in a layer wins over every
layer below it, whether or not it equals Config's default. The Config is made once, from the merged values, so a
layer alone need not be a valid Config.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import FIELDS, Config
from .values import ConfigError


@dataclass(frozen=True)
class Layer:
    """The values one layer sets, {field: value}, and where they come from (as `--print-config` names it)."""

    origin: str
    values: dict = field(default_factory=dict)


def merged(layers: list[Layer]) -> tuple[dict, dict]:
    """The values the layers set, each from the highest layer that sets it, and that layer's origin by field."""
    values, origins = {}, {}
    for layer in layers:
        unknown = sorted(set(layer.values) - set(FIELDS))
        if unknown:
            raise ConfigError(f"{layer.origin}: names no flag: {', '.join(unknown)}")
        values.update(layer.values)
        origins.update(dict.fromkeys(layer.values, layer.origin))
    return values, origins


def resolve(layers: list[Layer]) -> tuple[Config, dict]:
    """The Config of the layers, and where each value not Config's default came from ({field: origin});
    ConfigError (one line) where the merged values are not a valid Config, naming the layer of a refused value
    where it is not the command line's (a checkpoint records values an older version allowed)."""
    values, origins = merged(layers)
    try:
        return Config(**values), origins
    except ValueError as err:
        field_name = str(err).partition(":")[0].removeprefix("Config.")
        origin = origins.get(field_name)
        if origin is None or origin == "command line":
            raise
        raise ConfigError(f"{origin}: {err}") from None
