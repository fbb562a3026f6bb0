"""Read the preprocess step's Parquet shards into columnar memory and cut them into batches.

No Python loop per row: batches are gathered with vectorized jagged indexing (``sparse.jagged_take``).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persia_core import io
from persia_core.data import schema as S
from persia_core.sparse import Batch, IdBatch, jagged_take


def read_schema(data_dir: str) -> dict:
    """The ``schema.json`` written by preprocess. Raises ``FileNotFoundError`` naming the path."""
    path = io.join(data_dir, S.SCHEMA_FILE)
    if not io.exists(path):
        raise FileNotFoundError(f"{path}: no preprocess statistics (run the preprocess step first)")
    return json.loads(io.read_text(path))


def _list_column(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    values = values[offsets[0] : offsets[-1]]
    return values, offsets - offsets[0]


def _one_per_row(col: pa.ChunkedArray) -> bool:
    """Whether every row of list column ``col`` holds exactly one value (no null list)."""
    if col.null_count:
        return False
    if len(col) == 0:
        return True
    lengths = pc.min_max(pc.list_value_length(col))
    return lengths["min"].as_py() == 1 and lengths["max"].as_py() == 1


def _values_into(out: np.ndarray, col: pa.ChunkedArray) -> None:
    """Copy the values of list column ``col`` (one per row) into ``out: uint64[R]``, chunk by chunk."""
    pos = 0
    for chunk in col.chunks:
        v = chunk.flatten().to_numpy(zero_copy_only=False)
        out[pos : pos + len(v)] = v
        pos += len(v)


def _jagged_parts(
    fixed_row: np.ndarray, parts: list[list | None], slot: int, rows: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """``(uint64[n] values, int64[R+1] offsets)`` of one slot over every file: a file whose IDs went to the fixed
    matrix (``parts[f] is None``) has one per row in ``fixed_row``; the others have their Arrow column."""
    values, lengths, pos = [], [], 0
    for part, n in zip(parts, rows, strict=True):
        if part is None:
            values.append(fixed_row[pos : pos + n])
            lengths.append(np.ones(n, np.int64))
        else:
            v, o = _list_column(part[slot])
            values.append(v if v.dtype == np.uint64 else v.astype(np.uint64))
            lengths.append(np.diff(o))
        pos += n
    offsets = np.zeros(pos + 1, np.int64)
    if pos:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    return (np.concatenate(values) if values else np.zeros(0, np.uint64)), offsets


class ParquetExamples:
    """The rows of some Parquet shards, held columnar in memory.

    Args:
        files: Parquet paths (local, ``/gcs/`` or ``gs://``).
        slots: slot names to read (``slot_<name>`` columns).
        num_dense: the number of dense features F (from ``schema.json``). Needed when ``files`` hold no rows (a
            rank with no train file), so that its batches still have F dense columns; checked against the rows
            otherwise. None: taken from the rows (0 if there are none).

    Attributes: ``labels float32[R]``, ``dense float32[R, F]``, ``ids[slot] = (uint64[n], int64[R+1])``,
    ``ts int64[R]``; ``fixed uint64[S, R]`` when every slot has exactly one ID per row (else None).
    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` naming the file for a missing column or a
    dense width other than ``num_dense``.
    """

    def __init__(self, files: list[str], slots: list[str], num_dense: int | None = None):
        self.slots = list(slots)
        cols = [S.LABEL, S.DENSE, S.TS, *[S.slot_column(s) for s in slots]]
        opened = []
        for f in files:
            pf = open_shard(f)
            missing = [c for c in cols if c not in pf.schema_arrow.names]
            if missing:
                raise ValueError(f"{f}: missing columns {missing}")
            opened.append(pf)
        # one file at a time into arrays sized from the files' metadata, so that at most one file's Arrow table is
        # held beside them; only the needed columns are read (not the rows' source strings)
        self.num_rows = total = sum(pf.metadata.num_rows for pf in opened)
        self.labels = np.empty(total, np.float32)
        self.ts = np.empty(total, np.int64)
        width = None
        dense = np.empty((total, 0), np.float32)
        # one ID per row in every slot (Criteo-style one-hot features): the IDs are held as one matrix
        # ``uint64[S, R]`` and a batch is a single gather (``ids[slot]`` become views of its rows)
        fixed = np.empty((len(slots), total), np.uint64)
        parts: list[list | None] = []  # per file: None (its IDs are in ``fixed``) or its slot columns
        pos = 0
        for f, pf in zip(files, opened, strict=True):
            t = read_columns(pf, f, cols)
            n = t.num_rows
            self.labels[pos : pos + n] = t.column(S.LABEL).to_numpy()
            self.ts[pos : pos + n] = t.column(S.TS).to_numpy()
            if n:
                dv, do = _list_column(t.column(S.DENSE))
                w = int(do[1] - do[0])
                if not np.all(np.diff(do) == w) or (width is not None and w != width):
                    raise ValueError(f"{files}: rows have different numbers of dense features")
                if width is None:
                    width, dense = w, np.empty((total, w), np.float32)
                dense[pos : pos + n] = dv.reshape(n, w)
                del dv, do
            columns = [t.column(S.slot_column(s)) for s in slots]
            if all(_one_per_row(c) for c in columns):
                for i, c in enumerate(columns):
                    _values_into(fixed[i, pos : pos + n], c)
                parts.append(None)
            else:
                parts.append(columns)
            del t, columns
            pos += n
        width = width if width is not None else (num_dense or 0)
        if num_dense is not None and width != num_dense:
            raise ValueError(f"{files}: rows have {width} dense features, the schema {num_dense}")
        self.dense = dense if dense.shape[1] == width else np.empty((0, width), np.float32)
        self.fixed: np.ndarray | None = None
        if slots and all(p is None for p in parts):
            self.fixed = fixed
            one = np.arange(total + 1, dtype=np.int64)
            self.ids = {s: (fixed[i], one) for i, s in enumerate(slots)}
        else:
            self.ids = {
                s: _jagged_parts(fixed[i], parts, i, [pf.metadata.num_rows for pf in opened])
                for i, s in enumerate(slots)
            }
        del opened, parts
        pa.default_memory_pool().release_unused()  # the Arrow tables' and readers' memory, back to the system

    def __len__(self) -> int:
        return self.num_rows

    def save(self, folder: str) -> None:
        """Write the arrays as ``.npy`` files under local ``folder`` (``mapped`` reads them back), so that
        several processes share one copy through the page cache instead of each holding its own."""
        os.makedirs(folder, exist_ok=True)
        arrays = {"labels": self.labels, "dense": self.dense, "ts": self.ts}
        if self.fixed is not None:
            arrays["fixed"] = self.fixed
        else:
            for i, s in enumerate(self.slots):
                arrays[f"values{i}"], arrays[f"offsets{i}"] = self.ids[s]
        for name, a in arrays.items():
            np.save(os.path.join(folder, f"{name}.npy"), np.ascontiguousarray(a))
        with open(os.path.join(folder, "examples.json"), "w") as f:
            json.dump({"slots": self.slots, "num_rows": self.num_rows, "fixed": self.fixed is not None}, f)

    @classmethod
    def mapped(cls, folder: str) -> ParquetExamples:
        """The examples ``save`` wrote to ``folder``, memory-mapped read-only (no pickle). Raises
        ``FileNotFoundError`` naming a missing file."""
        with open(os.path.join(folder, "examples.json")) as f:
            meta = json.load(f)

        def load(name: str) -> np.ndarray:
            return np.load(os.path.join(folder, f"{name}.npy"), mmap_mode="r", allow_pickle=False)

        self = cls.__new__(cls)
        self.slots = list(meta["slots"])
        self.num_rows = int(meta["num_rows"])
        self.labels, self.dense, self.ts = load("labels"), load("dense"), load("ts")
        one = np.arange(self.num_rows + 1, dtype=np.int64)
        if meta["fixed"]:
            self.fixed = load("fixed")
            self.ids = {s: (self.fixed[i], one) for i, s in enumerate(self.slots)}
        else:
            self.fixed = None
            self.ids = {s: (load(f"values{i}"), load(f"offsets{i}")) for i, s in enumerate(self.slots)}
        return self

    def subset(self, rows: np.ndarray) -> ParquetExamples:
        """A copy holding only the examples ``rows: int64[R']``, in that order (vectorized gathers)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = ParquetExamples.__new__(ParquetExamples)
        out.slots, out.num_rows = list(self.slots), len(rows)
        out.labels, out.ts = np.take(self.labels, rows), np.take(self.ts, rows)
        out.dense = np.take(self.dense, rows, axis=0)
        one = np.arange(len(rows) + 1, dtype=np.int64)
        if self.fixed is not None:
            out.fixed = np.take(self.fixed, rows, axis=1)
            out.ids = {s: (out.fixed[i], one) for i, s in enumerate(out.slots)}
        else:
            out.fixed = None
            out.ids = {s: jagged_take(*self.ids[s], rows) for s in out.slots}
        return out

    def batch(self, rows: np.ndarray) -> Batch:
        """The examples ``rows: int64[B]`` as a ``Batch`` (slots in ``self.slots`` order)."""
        rows = np.asarray(rows, dtype=np.int64)
        # np.take: the same gathers as fancy indexing, in a faster loop (about half the time on [S, R] and [R, F])
        dense, labels = np.take(self.dense, rows, axis=0), np.take(self.labels, rows)
        if self.fixed is not None:
            values = np.take(self.fixed, rows, axis=1).reshape(-1)  # slot-major, as below
            ids = IdBatch(self.slots, values, np.arange(len(values) + 1, dtype=np.int64), len(rows))
            return Batch(ids, dense, labels)
        vals, offs, total = [], [np.zeros(1, dtype=np.int64)], 0
        for s in self.slots:
            v, o = jagged_take(*self.ids[s], rows)
            vals.append(v)
            offs.append(o[1:] + total)
            total += len(v)
        ids = IdBatch(
            self.slots, np.concatenate(vals) if vals else np.zeros(0, np.uint64), np.concatenate(offs), len(rows)
        )
        return Batch(ids, dense, labels)


def count_rows(files: list[str]) -> int:
    """Rows of the Parquet shards ``files``, from their footers (no column is decoded). Raises
    ``FileNotFoundError`` naming a missing shard."""
    total = 0
    for f in files:
        if not io.exists(f):
            raise FileNotFoundError(f"Parquet shard not found: {f}")
        if io.is_gcs(f):
            import io as _io

            total += pq.ParquetFile(_io.BytesIO(io.read_bytes(f))).metadata.num_rows
        else:
            total += pq.ParquetFile(f).metadata.num_rows
    return total


def shard_files(data_dir: str, split: str) -> list[str]:
    """Paths of the Parquet shards of ``split`` (``train`` or ``eval``) listed in ``schema.json``."""
    sch = read_schema(data_dir)
    return [io.join(data_dir, f) for f in sch[f"{split}_files"]]


def open_shard(f: str) -> pq.ParquetFile:
    """The Parquet shard ``f`` (local, ``/gcs/`` or ``gs://``: read whole into memory). Raises
    ``FileNotFoundError`` naming it when it is missing, ``ValueError`` naming it when it is not Parquet (truncated,
    overwritten)."""
    if not io.exists(f):
        raise FileNotFoundError(f"Parquet shard not found: {f}")
    try:
        if io.is_gcs(f):
            import io as _io

            return pq.ParquetFile(_io.BytesIO(io.read_bytes(f)))
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(
            f"{f}: not a readable Parquet shard ({e}); write the data folder again with the preprocess step"
        ) from None


def read_columns(pf: pq.ParquetFile, f: str, columns: list[str]) -> pa.Table:
    """``columns`` of the opened Parquet shard ``pf`` (file ``f``). Raises ``ValueError`` naming ``f`` when its
    pages cannot be decoded (a damaged file whose footer is intact)."""
    try:
        return pf.read(columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(
            f"{f}: a damaged Parquet shard ({e}); write the data folder again with the preprocess step"
        ) from None


def check_shards_readable(data_dir: str, split: str) -> None:
    """Open the footer of every Parquet shard of ``split`` of ``data_dir`` (``gs://`` ones excepted: opening one
    reads it whole), so that a damaged shard is refused before a job starts rather than by a worker. Raises
    ``FileNotFoundError`` or ``ValueError`` naming the first shard that is missing or not Parquet."""
    for f in shard_files(data_dir, split):
        if not io.is_gcs(f):
            open_shard(f)


def _read_column(files: list[str], column: str, dtype) -> np.ndarray:
    parts = [
        read_columns(open_shard(f), f, [column]).column(column).to_numpy().astype(dtype, copy=False) for f in files
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def read_ts(files: list[str]) -> np.ndarray:
    """``int64[R]``: the timestamp column of the Parquet shards ``files``, in order (no other column is decoded).
    Raises ``FileNotFoundError`` naming a missing shard."""
    return _read_column(files, S.TS, np.int64)


def read_labels(files: list[str]) -> np.ndarray:
    """``float32[R]``: the label column of the Parquet shards ``files``, in order (no other column is decoded).
    Raises ``FileNotFoundError`` naming a missing shard."""
    return _read_column(files, S.LABEL, np.float32)


def validation_cutoff(data_dir: str, fraction: float) -> int:
    """The timestamp that splits the train split of ``data_dir`` for ``epochs: auto``: rows with ``ts`` above it
    (at most ``ceil(fraction * R)`` of the R train rows, the latest; rows tied at the cutoff stay in training)
    are the validation slice. Preprocess numbers rows without a timestamp in file order, so that there it is the
    last fraction by order. Raises ``ValueError`` naming the data when the slice would be empty or all of it."""
    ts = read_ts(shard_files(data_dir, "train"))
    n = len(ts)
    k = int(np.ceil(fraction * n))
    if n < 2 or not 0 < k < n:
        raise ValueError(f"{data_dir}: {n} train rows are too few for a validation slice of {fraction:g}")
    cutoff = int(np.partition(ts, n - k - 1)[n - k - 1])
    if not (ts > cutoff).any():
        raise ValueError(
            f"{data_dir}: no validation slice: the latest {k} of {n} train rows share the timestamp {cutoff}"
        )
    return cutoff
