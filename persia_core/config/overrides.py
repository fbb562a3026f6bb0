"""Dotted-key overrides of a config's plain dict (``trainer.epochs``, ``embedding.tables.default.dim``)."""

from __future__ import annotations

import re
from typing import Any

from persia_core.config.errors import known_keys_hint


def apply_overrides(d: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``d`` (a config's plain dict) with each dotted-key override set in place; see ``RunConfig.with_overrides``.
    Raises ``ValueError`` naming the override and the unknown key or item."""
    for key, value in overrides.items():
        node = d
        parts = re.sub(r"\[([^\]]*)\]", r".\1", key).split(".")
        for p in parts[:-1]:
            node = _override_child(node, p, key)
        if not isinstance(node, dict) or parts[-1] not in node:
            raise ValueError(f"config override '{key}': unknown key '{parts[-1]}'{known_keys_hint(node, parts[-1])}")
        node[parts[-1]] = value
    return d


def _override_child(node: Any, part: str, key: str) -> Any:
    """``node[part]`` of a dict, or the item named (or indexed) ``part`` of a list of sections."""
    if isinstance(node, dict):
        if part not in node:
            raise ValueError(f"config override '{key}': unknown key '{part}'{known_keys_hint(node, part)}")
        return node[part]
    if isinstance(node, list):
        for item in node:
            if isinstance(item, dict) and item.get("name") == part:
                return item
        if part.isdigit() and int(part) < len(node):
            return node[int(part)]
        names = [item.get("name") for item in node if isinstance(item, dict)]
        raise ValueError(
            f"config override '{key}': no item '{part}' (by name: {names}; by index: 0 to {len(node) - 1})"
        )
    raise ValueError(f"config override '{key}': unknown key '{part}'")
