"""The embedding backend interface: what training and evaluation call on the store of embedding rows.

Two implementations, so that the trainer runs unchanged on either and a test runs the same batch through both
(``tests/embedding/test_backend_conformance.py``):

- ``persia_core.embedding.reference.LocalEmbedding``: every shard's tables in this process (the reference);
- ``persia_core.ps.client.EmbeddingClient``: the parameter-server shards over gRPC.

Both route feature ID ``i`` to shard ``hashing.shard_of(i, num_shards)`` (``embedding.routing``), and a table's
rows are created, initialized and updated by ``embedding.table.EmbeddingTable`` in both, so both give the same
rows for the same config, seed and calls. Each module checks under ``TYPE_CHECKING`` that its class satisfies
this Protocol (mypy).

Shapes: ``U`` IDs per call (the trainer passes each batch's distinct IDs), ``D = dims[table]``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np


class EmbeddingBackend(Protocol):
    """Embedding tables sharded by feature ID: look rows up, push gradients, dump and load shard files."""

    num_shards: int
    """N, the shards the feature IDs are routed over."""
    dims: dict[str, int]
    """Embedding dim D of each table, by table name."""

    def lookup(self, table: str, ids: np.ndarray, bounds: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids: uint64[U]`` of ``table`` as ``float32[U, D]``; an unseen ID gets a row (its
        deterministic initial value, or the zero row where the table's admission refuses it). Each call is one
        lookup step of every shard it reaches (recency, expiry). ``bounds: int64[N+1]``: ``ids`` are grouped by
        shard (``routing.group_by_shard``: shard s's are ``ids[bounds[s]:bounds[s+1]]``), so they are not
        routed again; ``ValueError`` when they do not fit."""
        ...

    def lookup_readonly(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids: uint64[U]`` of ``table`` as ``float32[U, D]``; an unseen ID reads the zero row and
        nothing is inserted, nor any recency changed (evaluation)."""
        ...

    def contains(self, table: str, ids: np.ndarray) -> np.ndarray:
        """``bool[U]``: whether each of ``ids: uint64[U]`` has a row in ``table``."""
        ...

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
        """Apply the gradients ``grads: float32[U, D]`` of distinct ``ids: uint64[U]`` (one optimizer step per
        row, ``EmbeddingTable.apply_gradients``). Returns a future whose result is the number of gradients
        dropped (their row was evicted since the lookup). A refused push (shapes, non-finite gradients) raises
        ``ValueError`` from ``push`` itself in process, ``ParameterServerError`` from the future's ``result``
        with servers.

        ``step``: the training step the push belongs to. ``sync_workers``: M > 1 when each of M workers pushes
        its share of every step and the shards combine them into one update (``staleness`` 0; the in-process
        backend, having one caller, applies every push at once). ``step_fraction``: the share of a step this
        push carries, ``lr_scale`` the learning rate's multiplier and ``epochs_trained`` the epochs trained
        (``EmbeddingTable.apply_gradients``).
        ``bounds``: as ``lookup``'s."""
        ...

    def flush(self) -> None:
        """Send what is buffered. Neither backend buffers pushes (each is sent at once): a push is known
        applied when its future is done."""
        ...

    def dump(self, paths: list[str]) -> list[tuple[int, int]]:
        """Write shard ``s``'s rows, optimizer state and recency to the shard file ``paths[s]`` (local path,
        ``/gcs/`` or ``gs://``; ``embedding.shard_file``), one path per shard. Returns ``(bytes, CRC-32C)`` of
        each file as written."""
        ...

    def load(self, paths: list[str], expected: list[tuple[int, int]] | None = None) -> None:
        """Replace shard ``s``'s tables with the shard file ``paths[s]``, one path per shard; ``expected``:
        ``(bytes, CRC-32C)`` of each file (what ``dump`` returned, or a manifest's), checked before anything of
        that shard is replaced. Raises ``ValueError`` when ``paths`` (or ``expected``) does not name one file per
        shard; ``FileNotFoundError`` or ``ShardFileError`` (in-process), ``ParameterServerError`` naming the
        shard (servers) for a missing, corrupt or unfitting file."""
        ...

    def stats(self) -> list[dict[str, Any]]:
        """Per shard: ``{"shard": s, "num_shards": N, "tables": {name: EmbeddingTable.stats()}}``; a parameter
        server adds its own counters (``pushes``, ``duplicate_pushes``, ``table_cpu_s``, ``process_cpu_s``)."""
        ...

    def close(self) -> None:
        """Release threads and connections; pushes already sent are waited for. No call may follow."""
        ...
