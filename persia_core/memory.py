"""Embedding memory accounting: bytes per row and row capacity for a memory budget (numpy only).

The in-process table (``persia_core.embedding.table``) allocates exactly what these functions count, the config
checks a shard's budget with them and the planners size shards with them, so all three agree by construction.

Memory per row (``bytes_per_row``), everything included::

    key uint64 (8) + last-used step int32 (4) + recency queue (row, step) int32 pairs (8 x 1.25 entries per row)
    + hash index int32 slots (4 / load)
    + weights (4 * D; 2 * D with fp16 or bf16 storage) + optimizer state (fp32: rowwise_adagrad 4,
    adagrad 4 * D, ftrl 8 * D, adam 8 * D + 4, sgd 0)
"""

from __future__ import annotations

import numpy as np

MAX_LOAD = 0.75
"""Highest load of the hash index (live rows / int32 slots) before it doubles."""
MIN_INDEX_SLOTS = 1024
"""Slots of the smallest hash index."""
QUEUE_FIXED_ENTRIES = 1024
"""Entries of the recency queue beyond its 1.25 per row (``kernels.queue_size``: ``rows + rows // 4 + 1024``)."""
QUEUE_FIXED_BYTES = 8 * QUEUE_FIXED_ENTRIES
"""The recency queue's bytes beyond its 1.25 entries per row (one entry: an int32 row and an int32 step)."""
STORAGE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
"""Bytes of one weight at each storage precision."""
MIN_ROWS = 1024
"""The fewest rows a table holds; a budget below ``min_budget_bytes`` is refused."""


def state_shapes(optimizer: str, dim: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """Optimizer state arrays per row: name -> (per-row shape, dtype). Raises ``ValueError`` for an unknown
    optimizer."""
    if optimizer == "sgd":
        return {}
    if optimizer == "rowwise_adagrad":
        return {"acc": ((), np.float32)}
    if optimizer == "adagrad":
        return {"acc": ((dim,), np.float32)}
    if optimizer == "ftrl":
        return {"acc": ((dim,), np.float32), "z": ((dim,), np.float32)}
    if optimizer == "adam":
        return {"m": ((dim,), np.float32), "v": ((dim,), np.float32), "steps": ((), np.int32)}
    raise ValueError(f"unknown optimizer {optimizer!r}")


def state_bytes(optimizer: str, dim: int) -> int:
    """Bytes of optimizer state per row (the arrays of ``state_shapes``). Raises ``ValueError`` for an unknown
    optimizer."""
    return sum(
        int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        for shape, dt in state_shapes(optimizer, dim).values()
    )


def row_bytes_without_index(optimizer: str, dim: int, storage: str = "fp32") -> int:
    """Bytes per row excluding the hash index: key, last-used step, recency-queue entries (1.25 per row, 8 bytes
    each), weights at ``storage`` precision, optimizer state (fp32). Raises ``ValueError`` for an unknown storage
    or optimizer."""
    if storage not in STORAGE_BYTES:
        raise ValueError(f"storage must be one of {sorted(STORAGE_BYTES)}, got {storage!r}")
    return 8 + 4 + 10 + STORAGE_BYTES[storage] * dim + state_bytes(optimizer, dim)


def index_slots(rows: int) -> int:
    """Slots of the hash index that holds ``rows`` rows: the smallest power of two >= 1024 at load <= MAX_LOAD."""
    n = MIN_INDEX_SLOTS
    while n * MAX_LOAD < rows:
        n *= 2
    return n


def capacity_and_slots(
    budget_bytes: int, optimizer: str, dim: int, storage: str = "fp32", max_rows: int | None = None
) -> tuple[int, int]:
    """The largest row count whose arrays and hash index fit in ``budget_bytes`` (bytes), at most ``max_rows``
    (None: no cap), and the hash-index slots it is sized for: ``(rows, slots)``, or ``(0, 0)`` when fewer than
    1024 rows fit.

    Searches the power-of-two slot counts from 1024 up, each holding at most ``MAX_LOAD`` rows per slot; the
    first count that reaches the most rows wins. Raises ``ValueError`` for an unknown storage or optimizer."""
    per_row = row_bytes_without_index(optimizer, dim, storage)
    budget_bytes -= QUEUE_FIXED_BYTES
    best, best_slots = 0, 0
    slots = MIN_INDEX_SLOTS
    while slots * 4 < budget_bytes:
        cap = min(int(slots * MAX_LOAD), (budget_bytes - 4 * slots) // per_row)
        if max_rows is not None:
            cap = min(cap, max_rows)
        if cap > best:
            best, best_slots = int(cap), slots
        slots *= 2
    return (best, best_slots) if best >= MIN_ROWS else (0, 0)


def capacity_for_budget(budget_bytes: int, optimizer: str, dim: int, storage: str = "fp32") -> int:
    """The largest row count whose arrays and hash index fit in ``budget_bytes`` (bytes) (``capacity_and_slots``).

    Raises ``ValueError`` if not even 1024 rows fit.
    """
    rows, _ = capacity_and_slots(budget_bytes, optimizer, dim, storage)
    if rows == 0:
        raise ValueError(
            f"a memory budget of {budget_bytes - QUEUE_FIXED_BYTES} bytes holds fewer than 1024 rows of dim {dim}"
        )
    return rows


def min_budget_bytes(optimizer: str, dim: int, storage: str = "fp32") -> int:
    """The smallest ``budget_bytes`` for which ``capacity_for_budget`` holds 1024 rows (bytes): 1024 rows, the
    index of 2048 slots their load of at most 0.75 needs, and the queue's fixed part."""
    return MIN_ROWS * row_bytes_without_index(optimizer, dim, storage) + 4 * index_slots(MIN_ROWS) + QUEUE_FIXED_BYTES


def bytes_per_row(optimizer: str, dim: int, capacity: int = 1 << 24, storage: str = "fp32") -> float:
    """Bytes per row at full ``capacity``, everything included (hash index slots amortized)."""
    return row_bytes_without_index(optimizer, dim, storage) + (4 * index_slots(capacity) + QUEUE_FIXED_BYTES) / capacity
