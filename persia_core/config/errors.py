"""Config errors that name the offending key: a field's failed check, an unknown key's close matches."""

from __future__ import annotations

import difflib
from typing import Any


def config_error(path: str, msg: str) -> ValueError:
    """``ValueError("config field '<path>': <msg>")``, for a field's check in ``__post_init__``."""
    return ValueError(f"config field '{path}': {msg}")


def known_keys_hint(node: Any, part: str) -> str:
    """`` (did you mean ...? known: [...])`` for an unknown key ``part`` of section ``node``; "" for a non-section."""
    if not isinstance(node, dict):
        return ""
    close = difflib.get_close_matches(part, list(node), n=1, cutoff=0.6)
    return (f" (did you mean '{close[0]}'? " if close else " (") + f"known: {sorted(node)})"
