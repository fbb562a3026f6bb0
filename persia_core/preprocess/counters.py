"""The Beam counters of the preprocess pipeline: one metrics namespace, one helper that names a counter in it.

The counters (``lines_read``, ``blank_lines``, ``rows``, ``malformed``, ``malformed_side_lines``,
``train_rows``, ``eval_rows``) are incremented by the DoFns of ``read``, ``delimited``, ``movielens`` and
``split``; a runner reports them under ``NAMESPACE``.
"""

from __future__ import annotations

import apache_beam as beam

NAMESPACE = "persia_preprocess"
"""Beam metrics namespace of the preprocess counters."""


def counter(name: str):
    """The Beam counter ``name`` in the preprocess namespace."""
    return beam.metrics.Metrics.counter(NAMESPACE, name)
