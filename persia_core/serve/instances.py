"""Prediction instances (the JSON of a request body) -> a ``Batch`` of the model's slots, as preprocess encodes rows.

Two forms, by the model's layout:

- ``delimited`` (Criteo): an instance is a JSON object keyed by the run config's column names. A string is the
  field's text; a number is the text the raw file would hold (an integer without a decimal point); ``null`` or an
  absent key is a missing field (the label column and a timestamp column may be left out: they are not features).
  The fields are parsed by ``layouts.delimited_columns`` and hashed by ``rows.slot_ids``: the functions the
  preprocess step and ``persia predict`` use on a file's lines (one line at a time, where the server takes a
  request's instances at once).
- ``movielens`` (which needs joins and the user's history): an instance is the preprocessed feature row, keyed as
  the Parquet columns of ``persia_core.data.schema``: ``slot_<name>`` a list of feature IDs (``uint64``) for every
  slot of the model (``null``, ``[]`` or absent: no ID), and ``dense`` a list of the model's F dense features
  (standardized inside the model; within float32 range); a row's ``label`` and ``ts`` may be sent and are ignored.

A bad instance raises ``InstanceError`` naming its index and field.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from persia_core.config import RunConfig
from persia_core.data import schema as S
from persia_core.preprocess import layouts
from persia_core.preprocess.rows import slot_ids, slot_specs
from persia_core.sparse import Batch, IdBatch


class InstanceError(ValueError):
    """A request instance that cannot be scored; the message names the instance index and the field."""

    def __init__(self, index: int | None, field: str | None, reason: str):
        where = f"instance {index}" if index is not None else "instances"  # None: the array itself, no instance
        where += f", field {field!r}" if field is not None else ""
        super().__init__(f"{where}: {reason}")
        self.index, self.field, self.reason = index, field, reason


def _field_text(value: Any, index: int, column: str) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):  # a JSON true/false is no field of a raw row (bool is an int in Python)
        raise InstanceError(index, column, f"a boolean is not a field's text; send a string or a number, got {value}")
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not np.isfinite(value):
            raise InstanceError(index, column, f"not a finite number: {value}")
        return repr(value)
    raise InstanceError(index, column, f"expected a string, a number or null, got {type(value).__name__}")


class InstanceEncoder:
    """Turns the instances of a request into a ``Batch`` whose slots are in ``model_slots`` order.

    Args: config (the model's run config), model_slots (``LoadedModel.slots``), num_dense F."""

    def __init__(self, config: RunConfig, model_slots: list[str], num_dense: int):
        self.config, self.layout = config, config.layout
        self.model_slots, self.num_dense = list(model_slots), num_dense
        self.specs = slot_specs(config)
        order = config.slot_names
        self.spec_of_slot = [order.index(s) for s in self.model_slots]  # encode_row's order -> the model's
        if self.layout.kind == "delimited":
            self.columns = list(self.layout.columns)
            self.known = set(self.columns)
            self.optional = {self.layout.label_column, self.layout.timestamp_column} - {None, ""}
            # the columns every instance must carry (the features), read with one C call per instance
            self.required = [c for c in self.columns if c not in self.optional]
            self.every_required = operator.itemgetter(*self.required) if len(self.required) > 1 else None

    def example(self) -> dict[str, Any]:
        """A made-up valid instance: every feature column ``"1"`` (a delimited layout), or one feature ID per slot
        and zero dense values (feature rows)."""
        if self.layout.kind == "delimited":
            return {c: "1" for c in self.required}
        return {S.slot_column(s): [1] for s in self.model_slots} | {S.DENSE: [0.0] * self.num_dense}

    def batch(self, instances: Any) -> Batch:
        """``instances`` (the request's ``"instances"``: a non-empty JSON array) -> ``Batch`` of B rows (labels 0).
        Raises ``InstanceError`` for the first bad instance."""
        if not isinstance(instances, list) or not instances:
            raise InstanceError(None, None, "'instances' must be a non-empty JSON array")
        if self.layout.kind == "delimited":
            return self._delimited(instances)
        return self.features_batch(instances)

    def _delimited(self, instances: list) -> Batch:
        known = self.known
        for i, inst in enumerate(instances):
            if type(inst) is not dict:
                raise InstanceError(i, None, f"expected a JSON object keyed by column name, got {type(inst).__name__}")
            if not inst.keys() <= known:
                unknown = next(k for k in inst if k not in known)
                raise InstanceError(i, unknown, f"not a column of the model's layout {self.columns}")
        got: dict[str, Sequence[Any]] = {}
        if self.every_required is not None:
            try:  # every instance has every feature column (the usual case): transposed in C
                got = dict(zip(self.required, zip(*map(self.every_required, instances), strict=True), strict=True))
            except KeyError:  # some feature field is absent (missing): column by column
                pass
        table = [got[c] if c in got else [inst.get(c) for inst in instances] for c in self.columns]
        columns: dict[str, list[str]] = {}
        for c, raw in zip(self.columns, table, strict=True):  # column by column: a few calls per column
            types = set(map(type, raw))
            if types == {str}:
                texts = list(raw)
            elif types == {int}:  # JSON integers: the text a raw file holds
                texts = list(map(str, raw))
            else:
                texts = [_field_text(v, i, c) for i, v in enumerate(raw)]
            if c in self.optional and not all(texts):
                texts = [t or "0" for t in texts]  # the label and the timestamp are not features: absent is fine
            columns[c] = texts
        try:
            parsed = layouts.delimited_columns(columns, self.layout)
        except layouts.ParseError as e:
            raise InstanceError(e.row or 0, e.field, e.reason) from None
        b = len(instances)
        ids = slot_ids(parsed.fields, self.specs, b, single=True)
        dense = parsed.dense.astype(np.float32)  # as preprocess stores them
        lengths = [ids[s][1] for s in self.spec_of_slot]
        return self._assemble(dense, lengths, np.concatenate([ids[s][0] for s in self.spec_of_slot]))

    def features_batch(self, instances: list) -> Batch:
        """Preprocessed feature rows (``slot_<name>`` feature IDs, ``dense`` values; the form of layouts that
        need joins) -> ``Batch``. Raises ``InstanceError`` for the first bad instance."""
        b, f = len(instances), self.num_dense
        dense = np.zeros((b, f), np.float32)
        per_slot: list[list[np.ndarray]] = [[] for _ in self.model_slots]
        columns = [S.slot_column(s) for s in self.model_slots]
        # a Parquet row as it is (what persia predict reads): its label, timestamp and source are ignored
        want = {S.DENSE, S.LABEL, S.TS, S.SOURCE, *columns}
        for i, inst in enumerate(instances):
            if not isinstance(inst, dict):
                raise InstanceError(i, None, f"expected a JSON object of the preprocessed columns, got {type(inst)}")
            if not inst.keys() <= want:
                unknown = next(k for k in inst if k not in want)
                raise InstanceError(i, unknown, f"not a column of the model's preprocessed rows {sorted(want)}")
            raw = inst.get(S.DENSE, [])
            if type(raw) is not list or not set(map(type, raw)) <= {int, float}:  # a JSON true is no number here
                raise InstanceError(i, S.DENSE, f"expected a list of {f} finite numbers")
            d = np.asarray(raw)
            if d.shape != (f,) or (f and (d.dtype.kind not in "iuf" or not np.isfinite(d).all())):
                raise InstanceError(i, S.DENSE, f"expected a list of {f} finite numbers")
            big = np.abs(d) > layouts.FLOAT32_MAX  # stored as float32: it would become inf, the prediction NaN
            if f and big.any():
                raise InstanceError(i, S.DENSE, f"a value beyond float32 range: {d[big][0]}")
            dense[i] = d
            for j, col in enumerate(columns):
                ids = inst.get(col)
                ids = [] if ids is None else ids  # null or absent: the slot has no ID
                try:  # integers only (the type check is one C-level pass; numpy refuses < 0 and >= 2^64)
                    if type(ids) is not list or not set(map(type, ids)) <= {int}:
                        raise TypeError
                    per_slot[j].append(np.array(ids, dtype=np.uint64))
                except (TypeError, OverflowError):
                    raise InstanceError(i, col, "expected a list of feature IDs (integers in [0, 2^64))") from None
        lengths = [np.fromiter((len(a) for a in bags), np.int64, b) for bags in per_slot]
        flat = [a for bags in per_slot for a in bags]
        values = np.concatenate(flat) if flat else np.zeros(0, np.uint64)
        return self._assemble(dense, lengths, values.astype(np.uint64, copy=False))

    def _assemble(self, dense: np.ndarray, lengths: list[np.ndarray], values: np.ndarray) -> Batch:
        b = dense.shape[0]
        offsets = np.zeros(len(self.model_slots) * b + 1, np.int64)
        if lengths:
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
        return Batch(IdBatch(self.model_slots, values, offsets, b), dense, np.zeros(b, np.float32))
