"""A shard's ``EmbeddingTable``s and their shard file: make them from the config, snapshot them to write,
check and restore them from a file read (``persia_core.embedding.shard_file`` is the format).

A table's arrays go into the file as they are held (layout ``storage``, no gather) and come back as the table's
own arrays when they fit; ``lru_state_dict`` gives any layout in ``EmbeddingTable.state_dict()`` form.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np

from persia_core.config import TableConfig, table_budgets
from persia_core.embedding import kernels as K
from persia_core.embedding.shard_file import (
    EXTRA_ARRAYS,
    RECENCY_ARRAYS,
    ShardContents,
    ShardFileError,
    TableArrays,
    read_shard_file,
    shard_arrays_bytes,
    write_shard_arrays,
)
from persia_core.embedding.table import EmbeddingTable
from persia_core.memory import capacity_for_budget, index_slots, state_shapes

log = logging.getLogger("persia.shards")


def make_tables(
    tables: list[TableConfig],
    shard_memory_bytes: int,
    seed: int = 0,
    capacities: dict[str, int] | None = None,
    storage: str = "fp32",
) -> dict[str, EmbeddingTable]:
    """One ``EmbeddingTable`` per table config for one shard, weights stored at ``storage`` precision. The
    shard's memory budget is split between tables by ``config.table_budgets`` unless ``capacities`` (rows per
    table) is given."""
    out = {}
    budgets = table_budgets(tables, shard_memory_bytes, storage)
    for t in tables:
        if capacities and t.name in capacities:
            cap = int(capacities[t.name])
        else:
            cap = capacity_for_budget(budgets[t.name], t.optimizer.name, t.dim, storage)
        out[t.name] = EmbeddingTable(
            t.dim,
            t.optimizer,
            cap,
            t.init_scale,
            seed,
            t.admit_probability,
            t.admit_after_sightings,
            t.expire_after_steps,
            storage,
        )
    return out


def table_arrays(t: EmbeddingTable) -> TableArrays:
    """The arrays of a table to write, as views of the table's own arrays (layout ``storage``); call with
    ``t.lock`` held until they are written. The hash index is written only when it is the size its rows alone
    need (``memory.index_slots``): a table sized for a capacity it has not reached would otherwise write an index
    for that capacity; a reader rebuilds a missing one."""
    base = {"dim": t.dim, "optimizer": t.optimizer.name, "dropped_gradients": int(t.dropped_gradients)}
    n = int(t.counters[0])
    arrays = {"keys": t.keys[:n], "weights": t.weights[:n]}
    arrays.update({k: v[:n] for k, v in t.state.items()})
    arrays.update(
        {
            "last_used": t.last_used[:n],
            "lru_rows": K.queue_order(t.qrow, t.qstep, t.qht, t.last_used, n),
            "counters": t.counters,
        }
    )
    if len(t.index) == index_slots(n):
        arrays["index"] = t.index
    _add_sketch(t, arrays)
    return TableArrays(arrays, {**base, "layout": "storage", "rows": n, "step": int(t.step)})


def _add_sketch(t: EmbeddingTable, arrays: dict[str, np.ndarray]) -> None:
    if t.admit_after > 0:
        arrays["sketch"] = t.sketch


def _restore_sketch(t: EmbeddingTable, arrays: dict[str, np.ndarray]) -> None:
    """Take back the admission sketch when both the file and the table count sightings (same size)."""
    sketch = arrays.get("sketch")
    if sketch is not None and t.admit_after > 0 and sketch.shape == t.sketch.shape:
        t.sketch[:] = sketch


@contextlib.contextmanager
def snapshot(tables: dict[str, EmbeddingTable]):
    """A consistent view of a shard's tables to write: every table's lock is held until the block ends (no
    lookup or update runs meanwhile). Yields ``{name: TableArrays}``."""
    with contextlib.ExitStack() as stack:
        for name in sorted(tables):
            stack.enter_context(tables[name].lock)
        yield {name: table_arrays(tables[name]) for name in tables}


def write_shard_file(
    path: str, tables: dict[str, EmbeddingTable], server: dict | None = None, fsync: bool = True
) -> tuple[int, int]:
    """Write the tables of one shard (and the server's bookkeeping ``server``) to ``path`` from a consistent
    ``snapshot``. Returns ``(bytes, CRC-32C)``."""
    with snapshot(tables) as arrays:
        return write_shard_arrays(path, arrays, server, fsync)


def shard_file_bytes(tables: dict[str, EmbeddingTable], server: dict | None = None) -> bytes:
    """The shard file of ``tables`` as bytes (same format as ``write_shard_file``)."""
    with snapshot(tables) as arrays:
        return shard_arrays_bytes(arrays, server)


# ---- restoring ----------------------------------------------------------------------------------------------
def _state_names(arrays: dict) -> set[str]:
    return set(arrays) - {"keys", "weights", "last_used", *RECENCY_ARRAYS, *EXTRA_ARRAYS}


def index_consistent(index: np.ndarray, keys: np.ndarray, samples: int = 4096) -> bool:
    """Whether a stored hash index serves ``keys`` (its row of key i is i): a power-of-two int32 array with one
    entry per row, entries in range, and ``samples`` evenly spread keys found at their rows. A table built by a
    changed hash function fails this and gets its index rebuilt."""
    n = len(keys)
    if index.dtype != np.int32 or index.ndim != 1 or len(index) & (len(index) - 1) or len(index) * 0.75 < n:
        return False
    if n == 0:
        return bool((index == -1).all())
    if int(index.max()) >= n or int(np.count_nonzero(index >= 0)) != n:
        return False
    rows = np.unique(np.linspace(0, n - 1, min(samples, n)).astype(np.int64))
    return bool((K.find_rows(np.ascontiguousarray(keys[rows]), index, keys) == rows).all())


def lru_state_dict(ta: TableArrays) -> dict[str, np.ndarray]:
    """A table's arrays as ``EmbeddingTable.state_dict()`` would give them: rows most recently used first."""
    a = ta.arrays
    names = ["keys", "weights", "last_used", *sorted(_state_names(a))]
    if ta.meta.get("layout") != "storage":
        out = {k: a[k] for k in names if k in a}
        out.setdefault("last_used", np.zeros(len(a["keys"]), np.int32))
        return out
    n = len(a["keys"])
    order = _lru_first(a, n)[::-1] if n else np.zeros(0, np.int64)
    if len(order) != n:
        raise ShardFileError(f"recency list covers {len(order)} of {n} rows")
    return {k: a[k][order] for k in names}


def _lru_first(a: dict, n: int) -> np.ndarray:
    """Rows of a layout-``storage`` table from least to most recently used (format 3: ``lru_rows``; format 2:
    its linked list)."""
    if "lru_rows" in a:
        return np.asarray(a["lru_rows"])
    return K.list_order(int(a["head_tail"][0]), a["nxt"], n)[::-1]


def restore_table(t: EmbeddingTable, ta: TableArrays, where: str = "", name: str = "") -> None:
    """Replace a table's contents with ``ta`` (read by ``read_shard_file``).

    Layout ``storage`` into a table of the same kind and enough capacity: arrays read for the table's capacity
    (``read_shard_file``'s ``reserve``) become the table's own (no copy), others are copied into the table's own
    arrays (sized for its capacity), and the index is the file's or the one built while reading when it has the
    table's size, else rebuilt. Otherwise the rows go in through ``load_state_dict`` in
    recency order; rows beyond the table's capacity (least recently used first) are dropped with a warning.
    Raises ``ShardFileError`` naming the table when the dim or the optimizer state do not match."""
    t.writable(f"{where}: restoring table {name!r}")
    a, label = ta.arrays, f"{where}: table {name!r}"
    n = len(a["keys"])
    _check_table_arrays(t, ta, label)
    expected = set(state_shapes(t.optimizer.name, t.dim))
    fast = (
        ta.meta.get("layout") == "storage"
        and n <= t.capacity
        and n >= 1024
        and all(
            a[k].dtype == own.dtype for k, own in (("keys", t.keys), ("weights", t.weights), ("last_used", t.last_used))
        )
        and all(a[k].dtype == t.state[k].dtype for k in expected)
    )
    if fast:
        order = _lru_first(a, n)
        if len(order) != n:
            raise ShardFileError(f"{label}: recency order covers {len(order)} of {n} rows")
        per_row = ("keys", "weights", "last_used", *expected)
        full = ta.reserved if all(len(ta.reserved.get(k, ())) == t.capacity for k in per_row) else None
        if full is None and n == t.capacity:
            full = {k: a[k] for k in per_row}
        with t.lock:
            if full is not None:  # the arrays read become the table's own
                t.keys, t.weights, t.last_used = full["keys"], full["weights"], full["last_used"]
                t.state = {k: full[k] for k in t.state}
            else:  # copied into the table's own arrays, which are sized for its capacity
                t.keys[:n], t.weights[:n], t.last_used[:n] = a["keys"], a["weights"], a["last_used"]
                for k in t.state:
                    t.state[k][:n] = a[k]
            index = next(
                (
                    i
                    for i in (a.get("index"), ta.index)
                    if i is not None and len(i) == len(t.index) and index_consistent(i, a["keys"])
                ),
                None,
            )
            if index is not None:
                t.index = index
            else:
                K.rebuild_index(t.index, t.keys, K.shift_of(t.index), n)
            K.queue_from_order(np.ascontiguousarray(order, dtype=np.int32), t.last_used, t.qrow, t.qstep, t.qht)
            t.counters[:] = a["counters"]
            t.counters[0] = n
            t.step = int(ta.meta.get("step", 0))
            t.dropped_gradients = int(ta.meta.get("dropped_gradients", 0))
            _restore_sketch(t, a)
        return
    sd = lru_state_dict(ta)
    if n > t.capacity:
        log.warning(
            "%s: %d rows do not fit the capacity %d; the %d least recently used are dropped",
            label,
            n,
            t.capacity,
            n - t.capacity,
        )
        sd = {k: v[: t.capacity] for k, v in sd.items()}
    try:
        t.load_state_dict(sd)
    except ValueError as e:
        raise ShardFileError(f"{label}: {e}") from e
    t.step = max(int(ta.meta.get("step", 0)), int(sd["last_used"].max()) if len(sd["last_used"]) else 0)
    t.dropped_gradients = int(ta.meta.get("dropped_gradients", 0))
    _restore_sketch(t, a)


def capacities_of(tables: dict[str, EmbeddingTable]) -> dict[str, int]:
    """Rows per table to read a shard file's arrays for (``read_shard_file``'s ``reserve``): each table's
    capacity."""
    return {name: t.capacity for name, t in tables.items()}


def load_shard_file(
    path: str, tables: dict[str, EmbeddingTable], expect_size: int | None = None, expect_crc32c: int | None = None
) -> dict:
    """Load a shard file into ``tables`` (every table in the file must be defined by the run config; tables the
    file lacks are left as they are). Returns the server bookkeeping stored with it.

    Raises ``FileNotFoundError``, or ``ShardFileError`` (a ``ValueError``) naming the file and the table that
    does not fit or the check that failed."""
    contents = read_shard_file(path, expect_size, expect_crc32c, reserve=capacities_of(tables))
    check_shard_contents(contents, tables, path)
    restore_shard_contents(contents, tables, path)
    return contents.server


def check_shard_contents(contents: ShardContents, tables: dict[str, EmbeddingTable], path: str = "") -> None:
    """Check every table of ``contents`` against ``tables`` before any is replaced, so that a file that does not
    fit replaces nothing: tables the run config defines, rows of its dim, its optimizer's state, and, for a table
    not in the ``storage`` layout (it goes in through ``load_state_dict``), no feature ID twice. A ``storage``
    table keeps its fast path: its hash index is checked (``index_consistent``) or rebuilt, not its keys one by
    one. Raises ``ShardFileError`` naming the file, table and check."""
    unknown = sorted(set(contents.tables) - set(tables))
    if unknown:
        raise ShardFileError(f"{path}: holds tables {unknown} that the run config does not define")
    for name, ta in contents.tables.items():
        _check_table_arrays(tables[name], ta, f"{path}: table {name!r}", duplicates=ta.meta.get("layout") != "storage")


def restore_shard_contents(contents: ShardContents, tables: dict[str, EmbeddingTable], path: str = "") -> None:
    """Replace the tables of ``contents`` (checked by ``check_shard_contents``) with its rows."""
    for name, ta in contents.tables.items():
        restore_table(tables[name], ta, path, name)


def _check_table_arrays(t: EmbeddingTable, ta: TableArrays, label: str, duplicates: bool = False) -> None:
    a = ta.arrays
    n = len(a["keys"])
    if a["weights"].shape != (n, t.dim):
        raise ShardFileError(f"{label}: rows have dim {a['weights'].shape[1:]} but the run config says {t.dim}")
    expected = set(state_shapes(t.optimizer.name, t.dim))
    present = _state_names(a)
    if present != expected:
        raise ShardFileError(
            f"{label}: optimizer state {sorted(present)} (optimizer "
            f"{ta.meta.get('optimizer', '?')}) does not match {t.optimizer.name} {sorted(expected)}"
        )
    if duplicates and n > 1 and len(K.dedup(np.ascontiguousarray(a["keys"], dtype=np.uint64))[0]) != n:
        raise ShardFileError(f"{label}: a feature ID appears in more than one row")
