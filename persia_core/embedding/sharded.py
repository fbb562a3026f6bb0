"""Embedding tables sharded by feature ID, in one process: the reference backend of the trainer.

``LocalEmbedding`` and the gRPC ``persia_core.ps.client.EmbeddingClient`` share one interface, so the trainer
runs unchanged on either, and a test compares the distributed run to this one:

    lookup(table, ids uint64[U]) -> float32[U, D]               create unseen rows
    lookup_readonly(table, ids uint64[U]) -> float32[U, D]      unseen -> zero row, nothing inserted
    push(table, ids uint64[U], grads float32[U, D], step, sync_workers) -> Future   apply one update
    flush(); stats() -> list[dict]; state_dicts() -> list[dict]
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from persia_core.config import EmbeddingConfig, TableConfig
from persia_core.embedding.table import EmbeddingTable, capacity_for_budget
from persia_core.hashing import shard_of


def make_tables(tables: list[TableConfig], shard_memory_bytes: int, seed: int = 0,
                capacities: dict[str, int] | None = None) -> dict[str, EmbeddingTable]:
    """One ``EmbeddingTable`` per table config for one shard. The shard's memory budget is split between
    tables in proportion to their bytes per row unless ``capacities`` (rows per table) is given."""
    out = {}
    for t in tables:
        if capacities and t.name in capacities:
            cap = int(capacities[t.name])
        else:
            cap = capacity_for_budget(shard_memory_bytes // len(tables), t.optimizer.name, t.dim)
        out[t.name] = EmbeddingTable(t.dim, t.optimizer, cap, t.init_scale, seed)
    return out


def load_shard_file(path: str, tables: dict[str, EmbeddingTable]) -> None:
    """Load a shard dump (``.npz`` of ``<table>.<array>``, no pickles) into ``tables``.

    Raises ``FileNotFoundError`` or ``ValueError`` naming the file and the table that does not fit."""
    from persia_core import io

    raw = io.read_bytes(path)
    import io as _io

    with np.load(_io.BytesIO(raw), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    by_table: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in arrays.items():
        table, _, name = key.partition(".")
        by_table.setdefault(table, {})[name] = arr
    unknown = sorted(set(by_table) - set(tables))
    if unknown:
        raise ValueError(f"{path}: holds tables {unknown} that the run config does not define")
    for name, sd in by_table.items():
        try:
            tables[name].load_state_dict(sd)
        except ValueError as e:
            raise ValueError(f"{path}: table {name!r}: {e}") from e


def shard_file_bytes(tables: dict[str, EmbeddingTable]) -> bytes:
    """Serialize the tables of one shard as ``.npz`` bytes (``<table>.<array>`` entries)."""
    import io as _io

    arrays = {}
    for name, t in tables.items():
        for k, v in t.state_dict().items():
            arrays[f"{name}.{k}"] = v
    buf = _io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _done(value=None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class LocalEmbedding:
    """All shards' tables in this process; routing as in the distributed case (``hashing.shard_of``).

    Pushes are applied immediately (and the returned future is already done)."""

    def __init__(self, config: EmbeddingConfig, num_shards: int | None = None, seed: int = 0):
        self.config = config
        self.num_shards = num_shards or config.num_shards
        self.shards = [make_tables(config.tables, config.shard_memory_bytes, seed) for _ in range(self.num_shards)]
        self.dims = {t.name: t.dim for t in config.tables}

    def load(self, paths: list[str]) -> None:
        """Load one shard file per shard (``paths[i]`` into shard i)."""
        if len(paths) != self.num_shards:
            raise ValueError(f"{len(paths)} shard files for {self.num_shards} shards")
        for p, tables in zip(paths, self.shards):
            load_shard_file(p, tables)

    def _route(self, ids: np.ndarray):
        owner = shard_of(ids, self.num_shards)
        return [np.flatnonzero(owner == s) for s in range(self.num_shards)]

    def _gather(self, table: str, ids: np.ndarray, readonly: bool) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.empty((len(ids), self.dims[table]), dtype=np.float32)
        for s, pos in enumerate(self._route(ids)):
            if len(pos):
                t = self.shards[s][table]
                out[pos] = t.lookup_readonly(ids[pos]) if readonly else t.lookup(ids[pos])
        return out

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        return self._gather(table, ids, readonly=False)

    def lookup_readonly(self, table: str, ids: np.ndarray) -> np.ndarray:
        return self._gather(table, ids, readonly=True)

    def contains(self, table: str, ids: np.ndarray) -> np.ndarray:
        out = np.zeros(len(ids), dtype=bool)
        for s, pos in enumerate(self._route(ids)):
            if len(pos):
                out[pos] = self.shards[s][table].contains(ids[pos])
        return out

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray, step: int = 0,
             sync_workers: int = 0) -> Future:
        for s, pos in enumerate(self._route(ids)):
            if len(pos):
                self.shards[s][table].apply_gradients(ids[pos], grads[pos])
        return _done()

    def flush(self) -> None:
        pass

    def stats(self) -> list[dict]:
        return [{name: t.stats() for name, t in tables.items()} for tables in self.shards]

    def close(self) -> None:
        pass
