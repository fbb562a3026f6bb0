"""Checks of command-line arguments shared by the CLIs (``persia``, ``persia plan``, the benchmarks)."""

from __future__ import annotations

import argparse
import math
import os

from persia_core import io
from persia_core.ps.storage_roots import resolve_storage_roots


def int_at_least(lo: int):
    """An argparse ``type`` accepting integers >= ``lo``; anything else is argparse's usage error (exit 2)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    parse.__name__ = f"integer >= {lo}"
    return parse


def port_number(text: str) -> int:
    """An argparse ``type`` accepting a TCP port, 0 (any free one) to 65535."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 (any free one) to 65535, got {v}")
    return v


def storage_root(text: str) -> str:
    """An argparse ``type`` for a parameter server's storage root: a local folder or a ``gs://bucket[/prefix]``;
    an empty value (an unset shell variable) or another URL scheme is argparse's usage error (exit 2), never
    "no root"."""
    try:
        resolve_storage_roots([text])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


storage_root.__name__ = "storage root"


def float_in(lo: float = -math.inf, hi: float | None = None):
    """An argparse ``type`` accepting finite numbers in [``lo``, ``hi``] (no bounds given: any finite number);
    ``inf``, ``nan`` and anything else are argparse's usage error (exit 2), naming the flag."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < lo or (hi is not None and v > hi):
            if hi is not None:
                msg = f"must be in [{lo:g}, {hi:g}], got {text}"
            elif lo > -math.inf:
                msg = f"must be a finite number >= {lo:g}, got {text}"
            else:
                msg = f"expected a finite number, got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        return v

    parse.__name__ = (
        "finite number"
        if lo == -math.inf and hi is None
        else f"number >= {lo:g}"
        if hi is None
        else f"number in [{lo:g}, {hi:g}]"
    )
    return parse


def check_output_file(flag: str, path: str) -> None:
    """Refuse a local output file ``path`` that cannot be created: an existing folder, or a path under a file.
    ``ValueError`` naming ``flag`` and the path; empty and ``gs://`` paths are not checked. Called before the work
    whose result goes there."""
    if not path or io.is_gcs(path):
        return
    local = io.to_fuse(path) if io.is_fuse(path) else path
    if os.path.isdir(local):
        raise ValueError(f"{flag} {path}: is a folder; give a file path")
    parent = os.path.dirname(os.path.abspath(local))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: cannot be created, {parent} is a file, not a folder")
