"""The in-process embedding backend: every shard's tables in this process (the reference implementation).

``LocalEmbedding`` routes feature IDs to shards exactly as the parameter-server client does
(``persia_core.embedding.routing``) and offers the same calls, so the trainer runs unchanged on either and a
test can run a batch through both and compare them.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from persia_core.config import EmbeddingConfig
from persia_core.embedding.routing import positions_by_shard
from persia_core.embedding.shard_tables import load_shard_file, make_tables, write_shard_file


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
        self.shards = [
            make_tables(config.tables, config.shard_memory_bytes, seed, storage=config.storage)
            for _ in range(self.num_shards)
        ]
        self.dims = {t.name: t.dim for t in config.tables}

    def load(self, paths: list[str]) -> None:
        """Load one shard file per shard (``paths[i]`` into shard i)."""
        if len(paths) != self.num_shards:
            raise ValueError(f"{len(paths)} shard files for {self.num_shards} shards")
        for p, tables in zip(paths, self.shards, strict=True):
            load_shard_file(p, tables)

    def _route(self, ids: np.ndarray) -> list[np.ndarray]:
        return positions_by_shard(ids, self.num_shards)

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

    def push(
        self,
        table: str,
        ids: np.ndarray,
        grads: np.ndarray,
        step: int = 0,
        sync_workers: int = 0,
        step_fraction: float = 1.0,
    ) -> Future:
        for s, pos in enumerate(self._route(ids)):
            if len(pos):
                self.shards[s][table].apply_gradients(ids[pos], grads[pos], step_fraction)
        return _done()

    def flush(self) -> None:
        pass

    def stats(self) -> list[dict]:
        return [{name: t.stats() for name, t in tables.items()} for tables in self.shards]

    def state_dicts(self) -> list[dict]:
        """Per shard, per table: ``EmbeddingTable.state_dict()``."""
        return [{name: t.state_dict() for name, t in tables.items()} for tables in self.shards]

    def dump(self, paths: list[str]) -> list[tuple[int, int]]:
        """Write shard i to ``paths[i]``; returns ``(bytes, CRC-32C)`` of each shard file."""
        return [write_shard_file(p, tables) for p, tables in zip(paths, self.shards, strict=True)]

    def close(self) -> None:
        pass
