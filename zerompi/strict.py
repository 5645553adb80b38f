"""The one typing rule of the configs' fields: NumPy scalars are taken as Python's, a bool is no number
and a float no int (ZeroConfig's docstring); one ConfigError line naming the field otherwise."""
from dataclasses import fields
from typing import Optional

import numpy as np

from .errors import ConfigError, check

# What each field's declared type admits (ZeroConfig's docstring): NumPy scalars are taken as Python's.
KINDS = {int: "int", Optional[int]: "int", float: "float", Optional[float]: "float", bool: "bool"}


def strict_value(name: str, kind: str, value):
    """``value`` of a field of kind "int", "float" or "bool" as ZeroConfig keeps it: a NumPy scalar as the
    Python int, float or bool it equals; ConfigError for a bool in a number's field or a float in an int's.
    Other types pass (the field's own check names what it allows)."""
    if kind == "bool":
        if isinstance(value, np.bool_):
            return bool(value)
        check(isinstance(value, bool), f"{name}={value!r} must be True or False (a bool, not {type(value).__name__})")
        return value
    if isinstance(value, (bool, np.bool_)):
        wanted = "whole number (an int)" if kind == "int" else "number"
        raise ConfigError(f"{name}={value!r} is a bool; give a {wanted}")
    if isinstance(value, np.integer):
        return int(value)
    if kind == "int" and isinstance(value, (float, np.floating)):
        whole = f": {int(value)}" if float(value).is_integer() else ""
        raise ConfigError(f"{name}={value!r} is a float; give a whole number (an int{whole})")
    return float(value) if isinstance(value, np.floating) else value


def strict_fields(config) -> None:
    """Store every int, float or bool field of the frozen dataclass ``config`` as :func:`strict_value` keeps it."""
    for f in fields(config):
        value = getattr(config, f.name)
        if f.type in KINDS and value is not None:
            object.__setattr__(config, f.name, strict_value(f.name, KINDS[f.type], value))
