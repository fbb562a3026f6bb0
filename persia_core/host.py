"""This host's resources as this process sees them."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on: its CPU affinity where the OS has one (Linux), else the host's CPU count
    (macOS, Windows); at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
