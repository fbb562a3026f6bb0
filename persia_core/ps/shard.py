"""One parameter-server shard's state: its ``EmbeddingTable``s, the push bookkeeping, dumps and loads (no gRPC).

Push semantics (PERSIA, Lian et al., KDD 2022, Sec. 4.2):
- ``sync_workers <= 1``: applied on arrival, in arrival order (asynchronous embedding training).
- ``sync_workers = M > 1``: the pushes of ``step`` from M distinct clients are concatenated, gradients of the
  same ID summed, and applied once; each of the M calls returns only after that (fully synchronous, K = 0).
- Exactly once: a push carries a per-client sequence number; a retried push already applied is acknowledged
  without being applied again. The records of applied numbers are part of the shard's dump, so they survive a
  restart from a checkpoint (clients of a resumed run also take new ids: see ``persia_core.train.worker``).

Incremental export: the IDs created by lookups and updated by pushes are recorded, and every T seconds their rows
are written as a delta file (``persia_core.embedding.delta``).

Requests are checked before anything is applied: ids must be ``uint64[U]``, a push's gradients ``float32[U, D]``
and finite, its ``step_fraction`` and ``lr_scale`` in (0, 1], its ``epochs_trained`` finite and >= 0. The gRPC
service around a shard is ``persia_core.ps.servicer``.
"""

from __future__ import annotations

import os
import stat
import threading
import time

import numpy as np

from persia_core.config import RunConfig
from persia_core.embedding.delta import DeltaExporter, DeltaTracker
from persia_core.embedding.shard_file import read_shard_file
from persia_core.embedding.shard_tables import (
    capacities_of,
    check_shard_contents,
    make_tables,
    restore_shard_contents,
    write_shard_file,
)


class _Applied:
    """Per-client record of applied sequence numbers: a watermark plus the set above it.

    A client numbers its pushes across all shards, so a shard sees gaps that never fill; the set is kept to
    ``MAX_ABOVE`` numbers by moving the watermark up past the oldest half (a push older than thousands of newer
    ones from the same client is taken as applied: with bounded staleness it cannot still be in flight)."""

    MAX_ABOVE = 4096

    def __init__(self, low: int = -1, above=()) -> None:
        self.low = int(low)
        self.above: set[int] = {int(a) for a in above}

    def seen(self, seq: int) -> bool:
        return seq <= self.low or seq in self.above

    def add(self, seq: int) -> None:
        self.above.add(seq)
        while self.low + 1 in self.above:
            self.low += 1
            self.above.discard(self.low)
        if len(self.above) > self.MAX_ABOVE:
            ordered = sorted(self.above)
            cut = ordered[len(ordered) // 2]
            self.low = cut
            self.above = {a for a in ordered if a > cut}

    def to_json(self) -> list:
        return [self.low, sorted(self.above)]


def check_push_arrays(table, ids: np.ndarray, grads: np.ndarray, finite: bool) -> None:
    """Refuse a push whose arrays do not fit ``table`` before anything is applied or buffered: ``ids`` must be
    ``uint64[U]``, ``grads`` ``float32[U, D]`` (D the table's dim), all finite when ``finite``. Raises
    ``ValueError`` naming what is wrong."""
    check_ids(ids, "push: ")
    if grads.dtype != np.float32 or grads.shape != (len(ids), table.dim):
        raise ValueError(f"push: grads must be float32[{len(ids)}, {table.dim}], got {grads.dtype}{list(grads.shape)}")
    if finite and not np.isfinite(grads).all():
        raise ValueError("push: gradients contain NaN or inf; nothing was applied")


def check_ids(ids: np.ndarray, what: str = "") -> np.ndarray:
    """``ids`` as sent: ``uint64[U]``, else ``ValueError`` (prefixed ``what``; no silent conversion of other
    dtypes)."""
    if ids.dtype != np.uint64 or ids.ndim != 1:
        raise ValueError(f"{what}ids must be uint64[U], got {ids.dtype}{list(ids.shape)}")
    return ids


def _is_number(x) -> bool:
    """Whether a request's field ``x`` is an int or a float (not a bool, which Python counts as an int)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class ParameterServerShard:
    """The tables of one shard plus push bookkeeping; the gRPC servicer calls into this (no gRPC here).

    Args:
        config: the run config (its ``embedding`` section defines the tables).
        shard: this shard's index; num_shards: shards in the plan.
        capacities: rows per table (from the shard plan); default: from ``embedding.shard_memory_bytes``.
    """

    def __init__(self, config: RunConfig, shard: int, num_shards: int, capacities: dict[str, int] | None = None):
        self.shard = shard
        self.num_shards = num_shards
        self.tables = make_tables(
            config.embedding.tables,
            config.embedding.shard_memory_bytes,
            seed=config.trainer.seed,
            capacities=capacities,
            storage=config.embedding.storage,
        )
        self.cond = threading.Condition()
        self.applied: dict[str, _Applied] = {}
        self.pending: dict[tuple[str, int], dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        self.done_steps: dict[str, int] = {}
        self.pushes = 0
        self.duplicates = 0
        self.table_cpu_s = 0.0  # CPU seconds spent in table lookups and gradient applies
        self.delta_seq = 0
        self.tracker: DeltaTracker | None = None  # while incremental export is on
        self.exporter: DeltaExporter | None = None

    def table(self, name: str):
        try:
            return self.tables[name]
        except KeyError:
            raise ValueError(f"shard {self.shard}: no table {name!r} (have {sorted(self.tables)})") from None

    def lookup(self, name: str, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids`` in table ``name``, created where unseen (recorded for the incremental export); written
        into ``out`` when given (``EmbeddingTable.lookup``)."""
        t0 = time.thread_time()
        rows = self.table(name).lookup(ids, out)
        self.table_cpu_s += time.thread_time() - t0
        if self.tracker is not None:
            self.tracker.record(name, ids)
        return rows

    def start_deltas(self, delta_dir: str, every_s: float, base_model: str = "") -> None:
        """Record changed rows and write them as delta files every ``every_s`` seconds (0: only on
        ``export_delta``). ``base_model``: ``manifest_digest`` of the model the run warm-started from ("" cold),
        recorded in each delta. See ``persia_core.embedding.delta``."""
        tracker = DeltaTracker(self.tables)
        exporter = DeltaExporter(
            self.tables, tracker, delta_dir, self.shard, every_s, self.delta_seq, lock=self.cond, base_model=base_model
        )
        self.tracker, self.exporter = tracker, exporter
        exporter.start()

    def export_delta(self) -> str | None:
        """Write the rows changed since the last delta now. Returns the file, or None when nothing changed."""
        if self.exporter is None:
            raise ValueError(f"shard {self.shard}: incremental export is off (no delta folder)")
        path = self.exporter.export()
        self.delta_seq = self.exporter.seq
        return path

    def push(self, meta: dict, ids: np.ndarray, grads: np.ndarray, timeout: float | None) -> dict:
        """Apply (or buffer, in sync mode) one gradient push; see the module docstring. Raises
        ``TimeoutError`` when a sync step is not completed by the other workers within ``timeout`` seconds."""
        table = self.table(meta["table"])
        client, seq = meta["client"], meta["seq"]
        step, m = meta.get("step", 0), meta.get("sync_workers", 0)
        fraction = meta.get("step_fraction", 1.0)
        lr_scale = meta.get("lr_scale", 1.0)
        epochs = meta.get("epochs_trained", 1.0)
        if not isinstance(client, str) or not client:
            raise ValueError(f"push: client must be a non-empty string, got {client!r}")
        for name, v in (("seq", seq), ("step", step), ("sync_workers", m)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"push: {name} must be an integer >= 0, got {v!r}")
        for name, x in (("step_fraction", fraction), ("lr_scale", lr_scale)):
            if not _is_number(x) or not 0.0 < x <= 1.0:
                raise ValueError(f"push: {name} must be in (0, 1], got {x!r}")
        if not _is_number(epochs) or not 0.0 <= epochs < float("inf"):
            raise ValueError(f"push: epochs_trained must be a finite number >= 0, got {epochs!r}")
        check_push_arrays(table, ids, grads, finite=m > 1)  # async: apply_gradients checks finiteness itself
        with self.cond:
            rec = self.applied.setdefault(client, _Applied())
            if m <= 1:
                if rec.seen(seq):
                    self.duplicates += 1
                    return {"applied": False, "duplicate": True, "dropped": 0}
                t0 = time.thread_time()
                dropped = table.apply_gradients(ids, grads, float(fraction), float(lr_scale), float(epochs))
                self.table_cpu_s += time.thread_time() - t0
                rec.add(seq)
                self.pushes += 1
                if self.tracker is not None:
                    self.tracker.record(meta["table"], ids)
                return {"applied": True, "duplicate": False, "dropped": dropped}
            key = (meta["table"], step)
            if not rec.seen(seq):
                if client in self.pending.get(key, {}):
                    raise ValueError(
                        f"push: client {client!r} already pushed step {step} of table "
                        f"{meta['table']!r} (sequence numbers differ: not a retry)"
                    )
                self.pending.setdefault(key, {})[client] = (ids.copy(), grads.copy())
                rec.add(seq)
            else:
                self.duplicates += 1
            bucket = self.pending.get(key)
            if bucket is not None and len(bucket) >= m:
                all_ids = np.concatenate([b[0] for b in bucket.values()])
                all_grads = np.concatenate([b[1] for b in bucket.values()])
                t0 = time.thread_time()
                dropped = table.apply_gradients(
                    all_ids, all_grads, lr_scale=float(lr_scale), epochs_trained=float(epochs)
                )
                self.table_cpu_s += time.thread_time() - t0
                if self.tracker is not None:
                    self.tracker.record(meta["table"], all_ids)
                del self.pending[key]
                self.done_steps[meta["table"]] = max(self.done_steps.get(meta["table"], -1), step)
                self.pushes += 1
                self.cond.notify_all()
                return {"applied": True, "duplicate": False, "dropped": dropped}
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.done_steps.get(meta["table"], -1) < step:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"shard {self.shard}: sync step {step} of table {meta['table']!r} got "
                        f"{len(self.pending.get(key, {}))} of {m} workers' pushes in time"
                    )
                self.cond.wait(remaining)
            return {"applied": True, "duplicate": False, "dropped": 0}

    def stats(self) -> dict:
        with self.cond:
            return {
                "shard": self.shard,
                "num_shards": self.num_shards,
                "pushes": self.pushes,
                "duplicate_pushes": self.duplicates,
                "table_cpu_s": round(self.table_cpu_s, 6),
                "process_cpu_s": round(time.process_time(), 6),
                "tables": {n: t.stats() for n, t in self.tables.items()},
            }

    def server_state(self) -> dict:
        """The bookkeeping that goes into a dump: applied-push records per client, last combined step per table
        (K = 0), counters, and the number of the last delta exported."""
        return {
            "shard": self.shard,
            "num_shards": self.num_shards,
            "applied": {c: r.to_json() for c, r in self.applied.items()},
            "done_steps": dict(self.done_steps),
            "pushes": self.pushes,
            "duplicates": self.duplicates,
            "delta_seq": self.exporter.seq if self.exporter is not None else self.delta_seq,
        }

    def restore_server_state(self, state: dict) -> None:
        """Take back ``server_state()`` from a dump of the same shard (a state re-sharded from other shards has
        none)."""
        if not state or state.get("shard") != self.shard or state.get("num_shards") != self.num_shards:
            return
        self.applied = {c: _Applied(low, above) for c, (low, above) in state.get("applied", {}).items()}
        self.done_steps = {k: int(v) for k, v in state.get("done_steps", {}).items()}
        self.pushes = int(state.get("pushes", 0))
        self.duplicates = int(state.get("duplicates", 0))
        self.delta_seq = int(state.get("delta_seq", 0))

    def dump(self, path: str) -> tuple[int, int]:
        """Write this shard's rows, optimizer state, recency list and bookkeeping to ``path`` (local or gs://),
        with no push applied meanwhile. Returns ``(bytes written, CRC-32C)``."""
        with self.cond:
            return write_shard_file(path, self.tables, self.server_state())

    def load(self, path: str, expect_size: int | None = None, expect_crc32c: int | None = None) -> None:
        """Replace this shard's state with a shard file's. The file is read and checked before the shard's lock
        is taken, so calls keep being served meanwhile, and nothing is replaced unless every table in it fits.
        Raises ``ShardFileError`` when the file is partial, corrupt (size or CRC-32C differ from the expected
        ones) or does not fit the run config, ``ValueError`` when a local path is not a regular file (a device,
        a pipe or a folder), ``FileNotFoundError`` when it is missing."""
        if "://" not in path:
            mode = os.stat(path).st_mode  # FileNotFoundError when missing
            if not stat.S_ISREG(mode):
                raise ValueError(f"load: {path} is not a regular file")
        contents = read_shard_file(path, expect_size, expect_crc32c, reserve=capacities_of(self.tables))
        check_shard_contents(contents, self.tables, path)
        with self.cond:
            restore_shard_contents(contents, self.tables, path)
            self.restore_server_state(contents.server)
        if self.exporter is not None:  # the deltas after the loaded state are superseded (embedding.delta)
            server = contents.server or {}
            same = server.get("shard") == self.shard and server.get("num_shards") == self.num_shards
            self.exporter.supersede_after(int(server.get("delta_seq", 0)) if same else 0)


def warm_up(config: RunConfig) -> None:
    """Run each table's lookup, read-only lookup and gradient apply once on a throwaway 1024-row table of the same
    dim, optimizer and storage, so that the compiled kernels are compiled (or loaded from numba's cache) before
    the server takes calls: on a fresh container the first call would otherwise spend its deadline compiling."""
    tables = make_tables(
        config.embedding.tables,
        0,
        config.trainer.seed,
        capacities={t.name: 1024 for t in config.embedding.tables},
        storage=config.embedding.storage,
    )
    ids = np.arange(8, dtype=np.uint64)
    for t in tables.values():
        t.lookup(ids)
        t.lookup_readonly(ids)
        t.apply_gradients(ids, np.zeros((len(ids), t.dim), np.float32))
