"""The encoded row: the compact tuple one example is inside the preprocess pipeline, and its dead letters.

An encoded row is a tuple, compact to shuffle::

    (label: float, dense: bytes (float32[F]), slots: tuple[bytes (uint64[n_s])], ts: int, source: str,
     key: int (63-bit xxh3 of source, orders rows within and across shards))

``LABEL`` .. ``KEY`` index it; ``decode_row`` and ``rows_to_table`` turn rows into the Parquet columns of
``persia_core.data.schema``. A dead letter is the dict of a line that is not a valid example (``dead_letter``);
DoFns emit it on their ``DEAD`` output. No Beam here: ``persia predict`` encodes raw rows with these too.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from persia_core import hashing
from persia_core.config import RunConfig
from persia_core.data import schema
from persia_core.preprocess import layouts

LABEL, DENSE, SLOTS, TS, SOURCE, KEY = range(6)
"""Indices into an encoded row tuple."""

DEAD = "dead"
"""Tag of the dead-letter output of a DoFn."""


def slot_specs(config: RunConfig) -> list[tuple[str, list[str], bool]]:
    """``(slot name, layout fields, is_cross)`` for each slot of ``config``, in config order."""
    return [(s.name, s.fields(), bool(s.cross)) for s in config.slots]


def source_key(source: str) -> int:
    """The 63-bit hash of a row's ``source`` that places it in a shard (non-negative, fits int64)."""
    return xxhash.xxh3_64_intdigest(source.encode("utf-8")) >> 1


def slot_ids(fields: Mapping[str, Sequence], specs: list[tuple[str, list[str], bool]], n: int, single: bool = False):
    """The feature IDs of ``n`` examples' slots: ``fields[name][i]`` is example i's values of a layout field
    (``[]`` = missing), or with ``single`` its one text (``""`` = missing: a delimited layout's columns). Per slot
    of ``specs`` (``slot_specs``), ``(ids, lengths)``: the examples' IDs one after the other, and how many each
    has: ``hashing.feature_ids(slot, values)`` of the source field, or of ``hashing.cross_values`` of the crossed
    fields' values (one ID per combination; none when any crossed field is empty). Without ``single`` (a row at a
    time: ``encode_row`` is ``n = 1``) lists of ints, one hashing call per slot; with ``single`` (a request's
    batch) ``uint64[N]`` and ``int64[n]`` arrays, the uncrossed slots' IDs hashed in one compiled call
    (``hashing.feature_ids_of_slots``)."""
    if single:
        return _single_slot_ids(fields, specs, n)
    out = []
    for name, names, is_cross in specs:
        cols = [fields[f] for f in names]
        per_row = [hashing.cross_values([c[i] for c in cols]) for i in range(n)] if is_cross else cols[0]
        flat = per_row[0] if n == 1 else [v for values in per_row for v in values]
        out.append((hashing.feature_ids(name, flat), [len(values) for values in per_row]))
    return out


def _single_slot_ids(fields: Mapping[str, Sequence], specs: list[tuple[str, list[str], bool]], n: int) -> list:
    plain, plain_lengths = [], []
    for _, names, is_cross in specs:
        if is_cross:
            continue
        texts = fields[names[0]]
        if all(texts):
            plain.append(texts)
            plain_lengths.append(np.ones(n, np.int64))
        else:
            plain.append([t for t in texts if t])
            plain_lengths.append(np.fromiter(map(bool, texts), np.int64, n))
    hashed = iter(hashing.feature_ids_of_slots([name for name, _, c in specs if not c], plain))
    lengths = iter(plain_lengths)
    out = []
    for name, names, is_cross in specs:
        if not is_cross:
            out.append((next(hashed), next(lengths)))
            continue
        cols = [[[t] if t else [] for t in fields[f]] for f in names]
        per_row = [hashing.cross_values([c[i] for c in cols]) for i in range(n)]
        flat = [v for values in per_row for v in values]
        ids = np.array(hashing.feature_ids(name, flat), dtype=np.uint64)
        out.append((ids, np.fromiter(map(len, per_row), np.int64, n)))
    return out


def encode_row(record: layouts.Record, specs: list[tuple[str, list[str], bool]], source: str, ts: int) -> tuple:
    """A parsed record -> an encoded row tuple (see the module docstring); its slot IDs are ``slot_ids``'."""
    fields = record["fields"]
    ids = slot_ids({f: [v] for f, v in fields.items()}, specs, 1)
    return (
        float(record["label"]),
        array("f", record["dense"]).tobytes(),
        tuple(array("Q", slot).tobytes() for slot, _ in ids),
        int(ts),
        source,
        source_key(source),
    )


def decode_row(row: tuple, slot_names: list[str]) -> dict[str, Any]:
    """An encoded row as a dict of the Parquet columns (``label``, ``dense``, ``slot_<s>``, ``ts``, ``source``).

    ``dense`` is a list of float32 values as Python floats, each slot a list of Python ints in [0, 2^64).
    """
    out: dict[str, Any] = {schema.LABEL: row[LABEL], schema.DENSE: array("f", row[DENSE]).tolist()}
    for name, blob in zip(slot_names, row[SLOTS], strict=True):
        out[schema.slot_column(name)] = array("Q", blob).tolist()
    out[schema.TS] = row[TS]
    out[schema.SOURCE] = row[SOURCE]
    return out


def rows_to_table(rows: list[tuple], slot_names: list[str], num_dense: int):
    """Encoded rows -> a ``pyarrow.Table`` with ``schema.arrow_schema(slot_names)``, built column-wise."""
    n = len(rows)
    arrow_schema = schema.arrow_schema(slot_names)
    columns = [pa.array(np.fromiter((r[LABEL] for r in rows), np.float32, n), pa.float32())]
    dense_values = np.frombuffer(b"".join(r[DENSE] for r in rows), np.float32)
    dense_offsets = (np.arange(n + 1, dtype=np.int64) * num_dense).astype(np.int32)
    columns.append(pa.ListArray.from_arrays(pa.array(dense_offsets), pa.array(dense_values, pa.float32())))
    for i in range(len(slot_names)):
        blobs = [r[SLOTS][i] for r in rows]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter((len(b) >> 3 for b in blobs), np.int64, n), out=offsets[1:])
        values = np.frombuffer(b"".join(blobs), np.uint64)
        columns.append(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, pa.uint64())))
    columns.append(pa.array(np.fromiter((r[TS] for r in rows), np.int64, n), pa.int64()))
    columns.append(pa.array([r[SOURCE] for r in rows], pa.string()))
    return pa.Table.from_arrays(columns, schema=arrow_schema)


def dead_letter(path: str, line_no: int, raw: str, error: layouts.ParseError, example: bool) -> dict[str, Any]:
    """A dead letter: ``{"source": "<path>:<line_no>", "reason", "raw", "file", "kind", "example"}``
    (``example``: whether the line was an example, counted against the malformed budget)."""
    return {
        "source": f"{path}:{line_no}",
        "reason": error.reason,
        "raw": raw,
        "file": path,
        "kind": error.kind,
        "example": example,
    }
