"""One field's value checked as its flag would take it: its type, its parser, its range, its choices, a finite
number. The one check behind a flag (`argparse`), a configuration file's key (FILE:LINE) and `Config(...)`, each
with its own label in front of the same words.
"""
from __future__ import annotations

import difflib
import json
import math
import os

from ..errors import OneLineError
from .sections import FIELDS, KINDS


class ConfigError(OneLineError, ValueError):
    """A value or a combination of values no Config may hold: one line naming the field or the flags."""


def checked(name: str, value, label: str, error: type[Exception] = ConfigError, finite: bool = True):
    """`value` for the field `name` as its flag would take it (an int where a float goes becomes a float, a path
    object a string), or `error` whose one line starts with `label`. `finite=False`: a NaN or an infinity is left
    to `rules.validate`'s one line."""
    f, kinds = FIELDS[name], KINDS[name]
    if isinstance(value, os.PathLike) and "str" in kinds:
        value = os.fspath(value)
    if value is None:
        if "None" in kinds:
            return None
        raise error(f"{label}: expected {_expected(kinds)}, got null")
    if isinstance(value, bool):
        ok = "bool" in kinds
    elif isinstance(value, int):
        ok = "int" in kinds or "float" in kinds
    elif isinstance(value, float):
        ok = "float" in kinds
    elif isinstance(value, str):
        ok = "str" in kinds
    else:
        ok = False
    if not ok:
        raise error(f"{label}: expected {_expected(kinds)}, got {shown(value)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and "float" in kinds:
        value = float(value)
        if finite and not math.isfinite(value):
            raise error(f"{label}: expected a finite number, got {value}")
    parse = f.metadata.get("parse")
    if parse is not None:
        try:
            value = parse(str(value))
        except Exception as err:  # argparse.ArgumentTypeError, as the flag's
            raise error(f"{label}: {err}") from None
    problem = out_of_range(name, value)
    if problem is not None:
        raise error(f"{label}: {problem}")
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise error(f"{label}: expected one of {', '.join(map(str, choices))}, got {shown(value)}")
    return value


def out_of_range(name: str, value) -> str | None:
    """What is wrong with a number outside the field's range (`arg(minimum=..., below=...)`), or None."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    meta = FIELDS[name].metadata
    minimum, below, maximum = meta.get("minimum"), meta.get("below"), meta.get("maximum")
    if below is not None and (value >= below or minimum is not None and value < minimum):
        return f"must be in [{minimum:g}, {below:g}), got {value:g}" if minimum is not None else \
            f"must be < {below:g}, got {value:g}"
    if maximum is not None and (value > maximum or minimum is not None and value < minimum):
        return f"must be in [{minimum}, {maximum}], got {value}" if minimum is not None else \
            f"must be <= {maximum}, got {value}"
    if minimum is not None and value < minimum:
        return f"must be >= {minimum}, got {value}"
    return None


def did_you_mean(name: str) -> str:
    """" (did you mean beam_size?)" for a name close to a field's, else "": the hint of every unknown name
    (`Config(...)`'s keywords, a configuration file's keys)."""
    close = difflib.get_close_matches(str(name), FIELDS, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _expected(kinds: tuple[str, ...]) -> str:
    names = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string", "None": "null"}
    return " or ".join(names[k] for k in kinds if k in names)


def shown(value) -> str:
    return json.dumps(value) if isinstance(value, (bool, str, int, float)) or value is None else \
        f"a {type(value).__name__}"
