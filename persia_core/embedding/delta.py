"""Incremental export of a shard's tables (PERSIA's "incremental update" for online serving).

While training runs, a shard records the IDs it creates (lookups) and updates (gradient pushes). Every
``delta_every_s`` seconds it writes the current rows of those IDs, with their optimizer state, as a *delta file*,
numbered per shard::

    <delta_dir>/shard-SSSSS/delta-NNNNNNNN.npz     a shard file (``persia_core.embedding.shard_file``) whose tables
                                                   have layout "delta": keys, weights, optimizer state, last_used
                                                   of every row changed since delta N-1, plus ``evicted_keys``
                                                   (tombstones: the keys of the rows evicted or expired since delta
                                                   N-1, a key recreated since among them)

Applying a delta removes its ``evicted_keys``, then puts its rows in (a key evicted and recreated within one
interval ends with its new row and optimizer state), so a delta's size follows the change, not the table. Deltas
written before tombstones carry ``live_keys`` instead (every key the table held) and still apply: rows not among
them are removed; the rollback delta below carries them too. Rows in a delta are absolute values, not increments, so
applying a delta twice, or one whose changes a full dump already holds, is harmless. A full dump (checkpoint or
Model shard file) records in its server bookkeeping the number of the last delta exported before it (``delta_seq``);
the current table is that dump with every later delta applied in order (``apply_deltas``, ``deltas_after``). A shard
restarted from a checkpoint continues the numbering from the checkpoint's ``delta_seq`` and removes the deltas of
the lost run after it.

A shard that loads an earlier dump while exporting (``epochs: auto`` putting the best epoch's model back) marks the
deltas numbered after the dump's ``delta_seq`` *superseded* in ``<delta_dir>/shard-SSSSS/superseded.json``
(``{"superseded": [[first, last], ...]}``): they hold rows of a discarded model, and ``deltas_after`` (so
``load_with_deltas``) skips them. It then writes a *rollback* delta at once: the loaded rows of every ID those
deltas or the unexported changes touched, with ``live_keys``, so a consumer that had already applied the
superseded deltas (online serving, as they came) is back at the loaded state after applying it.

Each delta names the model its run warm-started from (``server["delta"]["base_model"]``: that model's
``model_store.manifest_digest``, "" for a cold start), so that a consumer holding that model knows the deltas are
its own (``persia serve --deltas``, ``persia_core.serve.deltas``); a server that stops writes one last delta of what
changed since its last export.

The IDs changed are recorded in the server's lookup and push paths, the keys removed by the tables' eviction
logs (``EmbeddingTable.log_evictions``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time

import numpy as np

from persia_core import io
from persia_core.config.trainer import check_delta_period
from persia_core.embedding import kernels as K
from persia_core.embedding.shard_file import ShardContents, TableArrays, read_shard_file, write_shard_arrays
from persia_core.embedding.shard_tables import lru_state_dict
from persia_core.embedding.table import EmbeddingTable, stacked
from persia_core.memory import index_slots

DELTA_NAME = re.compile(r"^delta-(\d{8})\.npz$")
SUPERSEDED_FILE = "superseded.json"
log = logging.getLogger("persia.delta")


def sorted_unique(ids: np.ndarray) -> np.ndarray:
    """Sorted distinct values of ``ids: uint64[N]`` (sort-based; ``np.unique`` without ``return_inverse`` takes
    a hash path that is much slower on uint64 in numpy 2.4)."""
    s = np.sort(np.asarray(ids, dtype=np.uint64))
    if len(s) == 0:
        return s
    return s[np.concatenate(([True], s[1:] != s[:-1]))]


def make_delta_folder(folder: str) -> None:
    """Make the local folder ``folder`` of deltas (nothing for Cloud Storage, which has no folders to make).
    Raises ``ValueError`` naming it when it cannot be made (a file there, no permission)."""
    if io.is_gcs(folder):
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"delta_dir {folder!r} cannot be made a folder: {e}") from e


def check_delta_settings(delta_dir: str, every_s: float) -> None:
    """Refuse incremental-export settings that would only fail once the servers run (``check_delta_period``;
    ``make_delta_folder`` of ``delta_dir`` when deltas are on). Raises ``ValueError`` naming the setting."""
    check_delta_period(every_s)
    if every_s > 0 and delta_dir:
        make_delta_folder(delta_dir)


def delta_path(delta_dir: str, shard: int, seq: int) -> str:
    return io.join(delta_dir, f"shard-{shard:05d}", f"delta-{seq:08d}.npz")


def list_deltas(delta_dir: str, shard: int) -> list[tuple[int, str]]:
    """``(seq, path)`` of a shard's delta files, in order."""
    folder = io.join(delta_dir, f"shard-{shard:05d}")
    if not io.exists(folder):
        return []
    out = []
    for name in io.listdir(folder):
        m = DELTA_NAME.match(name)
        if m:
            out.append((int(m.group(1)), io.join(folder, name)))
    return sorted(out)


def _superseded_path(delta_dir: str, shard: int) -> str:
    return io.join(delta_dir, f"shard-{shard:05d}", SUPERSEDED_FILE)


def _superseded_ranges(delta_dir: str, shard: int) -> list[list[int]]:
    path = _superseded_path(delta_dir, shard)
    if not io.exists(path):
        return []
    try:
        ranges = json.loads(io.read_text(path))["superseded"]
        return [[int(a), int(b)] for a, b in ranges]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a list of superseded delta ranges ({e})") from e


def _write_superseded(delta_dir: str, shard: int, ranges: list[list[int]]) -> None:
    path = _superseded_path(delta_dir, shard)
    if ranges:
        io.write_text(path, json.dumps({"superseded": ranges}))
    elif io.exists(path):
        io.remove(path)


def superseded_deltas(delta_dir: str, shard: int) -> set[int]:
    """The numbers of a shard's deltas marked superseded (rows of a model its shard later replaced by an earlier
    dump). Raises ``ValueError`` naming a malformed ``superseded.json``."""
    return {seq for a, b in _superseded_ranges(delta_dir, shard) for seq in range(a, b + 1)}


def deltas_after(delta_dir: str, shard: int, delta_seq: int) -> list[str]:
    """Paths of a shard's deltas numbered above ``delta_seq`` (the ``delta_seq`` of a full dump), in order,
    superseded ones left out."""
    gone = superseded_deltas(delta_dir, shard)
    return [p for seq, p in list_deltas(delta_dir, shard) if seq > delta_seq and seq not in gone]


class DeltaTracker:
    """IDs created or updated per table since the last export (thread-safe; a few array appends per call), and
    the keys the tables removed (their eviction logs, turned on here)."""

    def __init__(self, tables: dict[str, EmbeddingTable]):
        self.tables = tables
        self.lock = threading.Lock()
        self.pending: dict[str, list[np.ndarray]] = {name: [] for name in tables}
        self.counts = {name: 0 for name in tables}
        for t in tables.values():
            t.log_evictions()
        self.force_live_keys = False  # the next take asks every table's live keys (the rollback delta)
        self.evicted_back: dict[str, list[np.ndarray]] = {name: [] for name in tables}  # from a failed export

    def record(self, table: str, ids: np.ndarray) -> None:
        """Note that the rows of ``ids: uint64[N]`` of ``table`` changed (or were created)."""
        if len(ids) == 0:
            return
        with self.lock:
            self.pending[table].append(np.array(ids, dtype=np.uint64, copy=True))
            self.counts[table] += len(ids)
            if self.counts[table] > (1 << 22) and len(self.pending[table]) > 64:  # bound memory: dedup now
                merged = sorted_unique(np.concatenate(self.pending[table]))
                self.pending[table] = [merged]
                self.counts[table] = len(merged)

    def take(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], bool]:
        """Since the last ``take``, per table: the changed IDs and the keys removed (each sorted, distinct), and
        whether the deltas must list the live keys (``force_live_keys``)."""
        with self.lock:
            pending, self.pending = self.pending, {name: [] for name in self.tables}
            self.counts = {name: 0 for name in self.tables}
            evicted = {
                name: sorted_unique(np.concatenate([*self.evicted_back[name], t.take_evicted()]))
                for name, t in self.tables.items()
            }
            self.evicted_back = {name: [] for name in self.tables}
            live, self.force_live_keys = self.force_live_keys, False
        ids = {n: sorted_unique(np.concatenate(p)) if p else np.zeros(0, np.uint64) for n, p in pending.items()}
        return ids, evicted, live

    def give_back(self, ids: dict[str, np.ndarray], evicted: dict[str, np.ndarray], live: bool) -> None:
        """Put back what ``take`` returned (an export that failed), so that the next ``take`` returns it again."""
        with self.lock:
            for name, a in ids.items():
                if len(a):
                    self.pending[name].append(a)
                    self.counts[name] += len(a)
            for name, a in evicted.items():
                if len(a):
                    self.evicted_back[name].append(a)
            self.force_live_keys |= live


def rows_of(t: EmbeddingTable, ids: np.ndarray, evicted: np.ndarray, live_keys: bool = False) -> TableArrays:
    """The current rows of ``ids: uint64[N]`` in table ``t`` (IDs without a row are left out), as a "delta" table
    with the tombstones ``evicted: uint64[E]`` (``evicted_keys``); with ``live_keys``, also every key the table
    holds."""
    meta = {"dim": t.dim, "optimizer": t.optimizer.name, "layout": "delta"}
    with t.lock:
        rows = K.find_rows(np.ascontiguousarray(ids, dtype=np.uint64), t.index, t.keys)
        rows = rows[rows >= 0]
        arrays = {"keys": t.keys[rows], "weights": t.weights[rows], "last_used": t.last_used[rows]}
        arrays.update({k: v[rows] for k, v in t.state.items()})
        arrays["evicted_keys"] = np.ascontiguousarray(evicted, dtype=np.uint64)
        if live_keys:
            arrays["live_keys"] = t.keys[: int(t.counters[0])].copy()
        meta["step"] = int(t.step)
    meta["rows"] = len(arrays["keys"])
    return TableArrays(arrays, meta)


class DeltaExporter:
    """Writes a shard's delta files, every ``every_s`` seconds on a background thread (``start``) or on demand
    (``export``).

    Args:
        tables: the shard's tables; tracker: their ``DeltaTracker``; delta_dir: root folder (local or gs://);
        shard: the shard's index; first_seq: the ``delta_seq`` of the state the shard started from (deltas of
        this shard numbered above it are removed: they belong to a run that did not reach this state).
        lock: held while the rows are read (the server's push lock), so a delta never splits a push.
        base_model: ``model_store.manifest_digest`` of the model the run warm-started from ("": a cold start),
            written into each delta (``server["delta"]["base_model"]``) so that a consumer applies it only on top
            of that model (``persia serve --deltas``).
    """

    def __init__(
        self,
        tables: dict,
        tracker: DeltaTracker,
        delta_dir: str,
        shard: int,
        every_s: float = 0.0,
        first_seq: int = 0,
        lock=None,
        base_model: str = "",
    ):
        self.tables = tables
        self.base_model = base_model
        self.tracker = tracker
        self.delta_dir = delta_dir
        self.shard = shard
        self.every_s = float(every_s)
        self.seq = int(first_seq)
        self.lock = lock
        self.since = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.export_lock = threading.Lock()
        # a folder that cannot be made fails the server's start, not its first export
        make_delta_folder(os.path.dirname(delta_path(delta_dir, shard, 1)))
        for seq, path in list_deltas(delta_dir, shard):
            if seq > self.seq:
                log.info("removing %s: after this shard's starting state (delta %d)", path, self.seq)
                if io.is_gcs(path):
                    io.remove(path)
                else:
                    os.remove(path)
        ranges = _superseded_ranges(delta_dir, shard)
        kept = [[a, min(b, self.seq)] for a, b in ranges if a <= self.seq]
        if kept != ranges:
            _write_superseded(delta_dir, shard, kept)

    def export(self) -> str | None:
        """Write the rows changed since the last export as the next delta file. Returns its path, or None when
        nothing changed."""
        with self.export_lock:
            return self._export()

    def supersede_after(self, loaded_seq: int) -> str | None:
        """The shard's tables were just replaced by a dump whose ``delta_seq`` is ``loaded_seq``: mark the deltas
        numbered after it superseded and write the rollback delta (module docstring). Returns its path."""
        with self.export_lock:
            self.seq = max(self.seq, loaded_seq)  # a later dump than any delta: number on after it
            if self.seq > loaded_seq:
                gone = superseded_deltas(self.delta_dir, self.shard)
                for seq, path in list_deltas(self.delta_dir, self.shard):
                    if loaded_seq < seq <= self.seq and seq not in gone:
                        for name, ta in read_shard_file(path, build_index=False).tables.items():
                            if name in self.tables:
                                self.tracker.record(name, ta.arrays["keys"])
                ranges = _superseded_ranges(self.delta_dir, self.shard)
                _write_superseded(self.delta_dir, self.shard, [*ranges, [loaded_seq + 1, self.seq]])
                log.info("deltas %d..%d superseded (loaded a dump of delta %d)", loaded_seq + 1, self.seq, loaded_seq)
            self.tracker.force_live_keys = True
            return self._export()

    def _export(self) -> str | None:
        def collect():
            taken = self.tracker.take()
            ids, evicted, live = taken
            tables = {
                n: rows_of(self.tables[n], ids[n], evicted[n], live)
                for n in self.tables
                if len(ids[n]) or len(evicted[n]) or live
            }
            return tables, taken

        if self.lock is not None:
            with self.lock:
                tables, taken = collect()
        else:
            tables, taken = collect()
        now = time.time()
        if not tables:
            self.since = now
            return None
        path = delta_path(self.delta_dir, self.shard, self.seq + 1)
        server = {
            "delta": {
                "seq": self.seq + 1,
                "since": self.since,
                "at": now,
                "shard": self.shard,
                "base_model": self.base_model,
            }
        }
        try:
            write_shard_arrays(path, tables, server, fsync=False)
        except Exception:  # nothing is lost: the next export writes these rows (their values then) under this number
            self.tracker.give_back(*taken)
            raise
        self.seq += 1
        self.since = now
        return path

    def start(self) -> None:
        """Export every ``every_s`` seconds until ``stop``."""
        if self.every_s <= 0 or self._thread is not None:
            return

        def loop():
            while not self._stop.wait(self.every_s):
                try:
                    self.export()
                except Exception:  # a failed export must not stop training; the next one retries
                    log.exception("delta export failed")

        self._thread = threading.Thread(target=loop, name=f"delta-export-{self.shard}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def member(keys: np.ndarray, of: np.ndarray) -> np.ndarray:
    """``bool[N]``: whether each of ``keys: uint64[N]`` is among ``of: uint64[M]``, by a hash index of ``of`` and
    one compiled lookup that release the GIL (``np.isin`` sorts both arrays holding it: a server applying deltas
    in a thread would stall its requests meanwhile)."""
    of = np.ascontiguousarray(of, dtype=np.uint64)
    if not len(of) or not len(keys):
        return np.zeros(len(keys), dtype=bool)
    index = np.empty(index_slots(len(of)), dtype=np.int32)
    K.rebuild_index(index, of, K.shift_of(index), len(of))
    return K.find_rows(np.ascontiguousarray(keys, dtype=np.uint64), index, of) >= 0


def apply_deltas(
    base: dict[str, dict[str, np.ndarray]], paths: list[str], contents: list[ShardContents] | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """Apply delta files in order to a table state.

    ``base``: per table a state in ``EmbeddingTable.state_dict()`` form (rows most recent first; e.g.
    ``lru_state_dict`` of a shard file's tables). Each delta replaces or adds its rows (placed most recent first,
    by their ``last_used``) after dropping its ``evicted_keys`` and, when it carries ``live_keys``, the rows not
    among them. ``contents``: the files of ``paths`` already read (``read_shard_file``), else they are read here.
    The deltas of a table are applied in one pass, newest first (each row copied once, not once per delta), unless
    one carries ``live_keys`` (the older format: then one after the other).
    Returns the new state per table. Raises ``ShardFileError`` for a corrupt delta file, ``ValueError`` for a
    delta whose arrays do not match the base's."""
    out = {n: dict(sd) for n, sd in base.items()}
    files = [
        contents[i] if contents is not None else read_shard_file(p, build_index=False) for i, p in enumerate(paths)
    ]
    for name in dict.fromkeys(n for f in files for n in f.tables):
        parts = []
        for path, f in zip(paths, files, strict=True):
            if name in f.tables:
                d = dict(f.tables[name].arrays)
                parts.append((path, d, d.pop("live_keys", None), d.pop("evicted_keys", None)))
        cur = out.get(name)
        if cur is None:
            cur = {k: v[:0] for k, v in parts[0][1].items()}
        for path, d, _, _ in parts:
            if set(cur) != set(d):
                raise ValueError(f"{path}: table {name!r} arrays {sorted(d)} do not match the base {sorted(cur)}")
        if any(live is not None for _, _, live, _ in parts):
            for _, d, live, evicted in parts:
                cur = _newest_first([(d, evicted)], cur, live)
            out[name] = cur
        else:
            out[name] = _newest_first([(d, evicted) for _, d, _, evicted in parts], cur)
    return out


def _newest_first(deltas: list[tuple[dict, np.ndarray | None]], cur: dict, live: np.ndarray | None = None) -> dict:
    """``cur`` with ``deltas`` (oldest first: rows, evicted keys) applied: each delta's rows most recent first,
    those of a later delta first, each kept unless a later delta holds or evicted its key; then ``cur``'s rows
    that no delta holds or evicted (and, with ``live`` for one delta, that ``live`` holds)."""
    pieces: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {k: [] for k in deltas[-1][0]}
    later: list[np.ndarray] = []  # keys that a newer delta holds or evicted
    for d, evicted in reversed(deltas):
        order = K.newest_first(np.ascontiguousarray(d["last_used"]))
        if later:
            order = order[~member(d["keys"], np.concatenate(later))[order]]
        for k in pieces:
            pieces[k].append((d[k], order))
        later.append(d["keys"])
        if evicted is not None and len(evicted):
            later.append(evicted)
    keep = ~member(cur["keys"], np.concatenate(later))
    if live is not None:
        keep &= member(cur["keys"], live)
    kept = np.flatnonzero(keep)
    return {k: stacked(pieces[k] + [(cur[k], kept)]) for k in pieces}


def load_with_deltas(shard_file: str, delta_dir: str, shard: int) -> dict[str, dict[str, np.ndarray]]:
    """A shard's current tables: its full dump with every later delta applied (see module docstring)."""
    contents = read_shard_file(shard_file, build_index=False)
    base = {n: lru_state_dict(ta) for n, ta in contents.tables.items()}
    start = int(contents.server.get("delta_seq", 0))
    return apply_deltas(base, deltas_after(delta_dir, shard, start))
