"""Checks of command-line arguments shared by the CLIs (``persia``, ``persia plan``, the benchmarks)."""

from __future__ import annotations

import argparse
import os


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


def check_output_file(flag: str, path: str) -> None:
    """Refuse a local output file ``path`` that cannot be created: an existing folder, or a path under a file.
    ``ValueError`` naming ``flag`` and the path; empty and ``gs://`` paths are not checked. Called before the work
    whose result goes there."""
    from persia_core import io

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
