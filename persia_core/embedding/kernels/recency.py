"""Recency of a table's rows for LRU eviction (numba kernels): the recency queue and its orderings.

As PERSIA's servers, the table evicts the least recently used row. Every row carries the step of its last lookup
(``last_used``), and a FIFO queue (a ring of ``(row, step)`` entries, ``qrow``/``qstep``, head and tail in
``qht``) gets an entry each time a row is first looked up in a step. An entry is live when its step is still the
row's ``last_used``; older entries of a row are stale and skipped. Entries enter in step order, so the first live
entry is the least recently used row, and within a step rows leave in the order they were first touched: exact
LRU at the granularity of lookup batches, at the cost of one write per touched row (a linked list would also
touch both neighbours). When the ring is full it is compacted in place to its live entries, at most one per row.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_core.embedding.kernels.intrinsics import PR, prefetch

DEAD = np.int32(-2147483648)
"""``last_used`` of a row removed by expiry (no queue entry has this step)."""


def queue_size(rows: int) -> int:
    """Entries of the recency queue of a table of ``rows`` allocated rows (live entries never exceed rows)."""
    return rows + rows // 4 + 1024


@njit(nogil=True, cache=True)
def _compact(qrow, qstep, qht, last_used, size):
    """Keep only the live entries of the recency queue, in order (in place). One sequential pass; the
    ``last_used`` reads it checks entries against are prefetched ``PR`` entries ahead."""
    q = qrow.shape[0]
    total = qht[1] - qht[0]
    p = qht[0] % q  # read position
    o = p  # write position (never ahead of p)
    ahead = p + PR
    if ahead >= q:
        ahead -= q
    kept = 0
    for _ in range(total):
        prefetch(last_used, qrow[ahead] if qrow[ahead] < size and qrow[ahead] >= 0 else 0)
        ahead += 1
        if ahead == q:
            ahead = 0
        r = qrow[p]
        st = qstep[p]
        if r < size and last_used[r] == st:
            qrow[o] = r
            qstep[o] = st
            kept += 1
            o += 1
            if o == q:
                o = 0
        p += 1
        if p == q:
            p = 0
    qht[1] = qht[0] + kept


@njit(nogil=True, cache=True)
def enqueue_many(qrow, qstep, qht, last_used, size, rows, n, step):
    """Append ``rows[:n]`` (in order) to the recency queue with entry step ``step``; compacts when full.

    One sequential write per entry (positions advance with a wrap check, no division per entry); the result is
    the same as appending the rows one at a time, compacting whenever the ring is full."""
    q = qrow.shape[0]
    done = 0
    while done < n:
        free = q - (qht[1] - qht[0])
        if free == 0:
            _compact(qrow, qstep, qht, last_used, size)
            free = q - (qht[1] - qht[0])
            if free == 0:  # cannot happen (live entries <= rows < queue size); never loop forever
                raise ValueError("recency queue full of live entries")
        m = min(free, n - done)
        p = qht[1] % q
        for i in range(done, done + m):
            qrow[p] = rows[i]
            qstep[p] = step
            p += 1
            if p == q:
                p = 0
        qht[1] += m
        done += m


@njit(nogil=True, cache=True)
def first_live(qrow, qstep, qht, last_used):
    """Drop stale entries at the head; returns the least recently used row (its entry stays) or -1."""
    q = qrow.shape[0]
    while qht[0] < qht[1]:
        p = qht[0] % q
        r = qrow[p]
        if last_used[r] == qstep[p]:
            return r
        qht[0] += 1
    return -1


@njit(nogil=True, cache=True)
def queue_from_order(order, last_used, qrow, qstep, qht):
    """Fill an empty recency queue from ``order: int[R]``, rows from least to most recently used."""
    for i in range(order.shape[0]):
        qrow[i] = order[i]
        qstep[i] = last_used[order[i]]
    qht[0] = 0
    qht[1] = order.shape[0]


@njit(nogil=True, cache=True)
def queue_order(qrow, qstep, qht, last_used, size):
    """Live rows from least to most recently used (``int32[size]`` when consistent)."""
    out = np.empty(size, dtype=np.int32)
    q = qrow.shape[0]
    k = 0
    for i in range(qht[0], qht[1]):
        p = i % q
        r = qrow[p]
        if r < size and last_used[r] == qstep[p] and k < size:
            out[k] = r
            k += 1
    return out[:k]


@njit(nogil=True, cache=True)
def list_order(head, nxt, size):
    """Rows from most to least recently used (``int64[size]``) of a linked recency list (``nxt``, from
    ``head``), as shard files of format ``persia-shard/2`` hold it."""
    order = np.empty(size, dtype=np.int64)
    r = head
    i = 0
    while r != -1 and i < size:
        order[i] = r
        r = nxt[r]
        i += 1
    return order[:i]


@njit(nogil=True, cache=True)
def newest_first(last_used):
    """``int64[N]``: the rows of ``last_used: int[N]`` (steps) most recent first, ties in row order (a stable sort,
    ``np.argsort(-last_used, kind="stable")``) without holding the GIL."""
    return np.argsort(-last_used.astype(np.int64), kind="mergesort")
