"""The in-process embedding backend: every shard's tables in this process (the reference implementation).

``LocalEmbedding`` routes feature IDs to shards exactly as the parameter-server client does
(``persia_core.embedding.routing``) and offers the same calls (``persia_core.embedding.backend.EmbeddingBackend``),
so the trainer runs unchanged on either and a test can run a batch through both and compare them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from persia_core.config import EmbeddingConfig
from persia_core.embedding.backend import EmbeddingBackend
from persia_core.embedding.routing import part_size, shard_parts
from persia_core.embedding.shard_file import read_shard_file
from persia_core.embedding.shard_tables import (
    check_shard_contents,
    load_shard_file,
    make_tables,
    restore_shard_contents,
    write_shard_file,
)
from persia_core.embedding.table import EmbeddingTable


def sized_tables(config: EmbeddingConfig, rows: dict[str, int], seed: int = 0) -> dict[str, EmbeddingTable]:
    """One shard's tables (``make_tables``), each with room for exactly ``rows[name]`` rows (at least 1; a table
    ``rows`` does not name: 1), for tables that only serve lookups."""
    capacities = {t.name: max(1, int(rows.get(t.name, 0))) for t in config.tables}
    return make_tables(config.tables, config.shard_memory_bytes, seed, capacities, storage=config.storage)


def _done(value: int) -> Future[int]:
    f: Future[int] = Future()
    f.set_result(value)
    return f


class LocalEmbedding:
    """All shards' tables in this process; routing as in the distributed case (``hashing.shard_of``). An
    ``EmbeddingBackend`` (see ``persia_core.embedding.backend`` for every call's shapes).

    Args:
        config: the embedding config (tables, shard memory budget, storage precision).
        num_shards: N (default: ``config.num_shards``).
        seed: seed of the per-ID row initializer (the servers use ``trainer.seed``).

    Pushes are applied at once, in the caller's thread: the returned future is already done, and a push that
    is refused (shapes, non-finite gradients) raises ``ValueError`` from ``push`` itself."""

    def __init__(
        self,
        config: EmbeddingConfig,
        num_shards: int | None = None,
        seed: int = 0,
        shards: list[dict[str, EmbeddingTable]] | None = None,
    ):
        self.config = config
        self.num_shards = num_shards or config.num_shards
        self.shards = (
            shards
            if shards is not None
            else [
                make_tables(config.tables, config.shard_memory_bytes, seed, storage=config.storage)
                for _ in range(self.num_shards)
            ]
        )
        if len(self.shards) != self.num_shards:
            raise ValueError(f"{len(self.shards)} shards' tables for {self.num_shards} shards")
        self.dims = {t.name: t.dim for t in config.tables}

    @classmethod
    def from_shard_files(
        cls,
        config: EmbeddingConfig,
        paths: list[str],
        expected: Sequence[tuple[int | None, int | None]] | None = None,
        seed: int = 0,
    ) -> LocalEmbedding:
        """One shard per file of ``paths``, each checked against ``expected[i]`` as ``load`` does, every table
        sized to the rows its file holds (``sized_tables``) instead of the shard's memory budget: for read-only use
        (evaluation, serving), where the budget's spare rows would only cost memory, and time to fill and free.
        The tables are frozen (``EmbeddingTable.freeze``): lookups that would create rows raise. Raises as
        ``load``."""
        if expected is not None and len(expected) != len(paths):
            raise ValueError(f"{len(expected)} expected (bytes, CRC-32C) for {len(paths)} shard files")
        shards = []
        for s, p in enumerate(paths):
            size, crc = expected[s] if expected is not None else (None, None)
            contents = read_shard_file(p, size, crc)
            rows = {name: len(ta.arrays["keys"]) for name, ta in contents.tables.items()}
            tables = sized_tables(config, rows, seed)
            check_shard_contents(contents, tables, p)
            restore_shard_contents(contents, tables, p)
            for t in tables.values():
                t.freeze()
            shards.append(tables)
        return cls(config, len(paths), seed, shards=shards)

    def load(self, paths: list[str], expected: Sequence[tuple[int | None, int | None]] | None = None) -> None:
        """Load one shard file per shard (``paths[i]`` into shard i), each checked against ``expected[i]``
        (``(bytes, CRC-32C)``, either None: not checked) when given."""
        if len(paths) != self.num_shards:
            raise ValueError(f"{len(paths)} shard files for {self.num_shards} shards")
        if expected is not None and len(expected) != self.num_shards:
            raise ValueError(f"{len(expected)} expected (bytes, CRC-32C) for {self.num_shards} shards")
        for s, (p, tables) in enumerate(zip(paths, self.shards, strict=True)):
            size, crc = expected[s] if expected is not None else (None, None)
            load_shard_file(p, tables, size, crc)

    def _route(self, ids: np.ndarray, bounds: np.ndarray | None = None) -> list[np.ndarray | slice]:
        return shard_parts(ids, self.num_shards, bounds)

    def _gather(self, table: str, ids: np.ndarray, readonly: bool, bounds: np.ndarray | None = None) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.empty((len(ids), self.dims[table]), dtype=np.float32)
        for s, pos in enumerate(self._route(ids, bounds)):
            if part_size(pos):
                t = self.shards[s][table]
                out[pos] = t.lookup_readonly(ids[pos]) if readonly else t.lookup(ids[pos])
        return out

    def lookup(self, table: str, ids: np.ndarray, bounds: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids: uint64[U]`` -> ``float32[U, D]``, created where unseen (``bounds``: as the Protocol's)."""
        return self._gather(table, ids, readonly=False, bounds=bounds)

    def lookup_readonly(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids: uint64[U]`` -> ``float32[U, D]``; unseen -> zero row, nothing inserted."""
        return self._gather(table, ids, readonly=True)

    def contains(self, table: str, ids: np.ndarray) -> np.ndarray:
        """``bool[U]``: whether each of ``ids: uint64[U]`` has a row."""
        out = np.zeros(len(ids), dtype=bool)
        for s, pos in enumerate(self._route(ids)):
            if part_size(pos):
                out[pos] = self.shards[s][table].contains(ids[pos])
        return out

    def push(
        self,
        table: str,
        ids: np.ndarray,
        grads: np.ndarray,
        step: int = 0,
        sync_workers: int = 0,
        step_fraction: float = 1.0,
        bounds: np.ndarray | None = None,
        lr_scale: float = 1.0,
        epochs_trained: float = 1.0,
    ) -> Future[int]:
        """Apply ``grads: float32[U, D]`` to the rows of ``ids: uint64[U]`` now (``step`` and ``sync_workers``
        are not needed in one process). Returns a done future of the number of gradients dropped."""
        dropped = 0
        for s, pos in enumerate(self._route(ids, bounds)):
            if part_size(pos):
                dropped += self.shards[s][table].apply_gradients(
                    ids[pos], grads[pos], step_fraction, lr_scale, epochs_trained
                )
        return _done(dropped)

    def flush(self) -> None:
        """Nothing to send: pushes are applied when made."""

    def stats(self) -> list[dict[str, Any]]:
        """Per shard: ``{"shard", "num_shards", "tables": {name: EmbeddingTable.stats()}}``."""
        return [
            {"shard": s, "num_shards": self.num_shards, "tables": {name: t.stats() for name, t in tables.items()}}
            for s, tables in enumerate(self.shards)
        ]

    def state_dicts(self) -> list[dict[str, dict[str, np.ndarray]]]:
        """Per shard, per table: ``EmbeddingTable.state_dict()``."""
        return [{name: t.state_dict() for name, t in tables.items()} for tables in self.shards]

    def dump(self, paths: list[str]) -> list[tuple[int, int]]:
        """Write shard i to ``paths[i]``; returns ``(bytes, CRC-32C)`` of each shard file."""
        return [write_shard_file(p, tables) for p, tables in zip(paths, self.shards, strict=True)]

    def close(self) -> None:
        """Nothing to release."""


if TYPE_CHECKING:  # mypy checks here that LocalEmbedding satisfies the EmbeddingBackend Protocol

    def _is_backend(backend: LocalEmbedding) -> EmbeddingBackend:
        return backend
