"""The generic builder: a plain dict (parsed YAML) into typed config dataclasses, naming the key on error."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any

from persia_core.config.errors import known_keys_hint

_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A number in exponent notation without a dot (``1e-3``), which YAML 1.1 leaves a string."""


def build(tp: Any, value: Any, path: str) -> Any:
    """Convert ``value`` into type ``tp`` (dataclass, list[...], or a scalar), naming ``path`` on error."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"config key '{path or '<root>'}': expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = [k for k in value if k not in names]
        if unknown:
            where = f"{path}." if path else ""
            raise ValueError(
                f"config key '{where}{unknown[0]}': unknown key{known_keys_hint(dict.fromkeys(names), str(unknown[0]))}"
            )
        kwargs = {k: build(hints[k], v, f"{path}.{k}" if path else k) for k, v in value.items()}
        try:
            return tp(**kwargs)
        except ValueError as e:
            if path and f"'{path}" not in str(e):  # a nested section's own check: say where it sits
                raise ValueError(f"{e} (in '{path}')") from None
            raise
    if origin in (typing.Union, types.UnionType):  # ``int | str``: the first member the value converts to
        errors = []
        for member in typing.get_args(tp):
            try:
                return build(member, value, path)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[-1])
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(f"config key '{path}': expected a list, got {type(value).__name__}")
        out = []
        for i, v in enumerate(value):
            item_path = f"{path}[{v.get('name', i)}]" if isinstance(v, dict) else f"{path}[{i}]"
            out.append(build(item_tp, v, item_path))
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key '{path}': expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ValueError(f"config key '{path}': expected an integer, got {value!r}")
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"config key '{path}': {value} does not fit in a 64-bit integer")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config key '{path}': expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"config key '{path}': expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"config key '{path}': expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} at {path}")
