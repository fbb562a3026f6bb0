"""Grouping a batch's IDs (numba kernels): deduplication, per-ID gradient sums, routing to shards."""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_core.embedding.kernels.index import home
from persia_core.embedding.kernels.intrinsics import PD, prefetch


@njit(nogil=True, cache=True)
def dedup(ids):
    """Deduplicate ``ids: uint64[N]`` with a scratch open-addressing table (O(N), no sort).

    Returns (``uint64[U]`` unique IDs in first-seen order, ``int64[N]`` inverse: ``uniq[inverse] == ids``).
    The scratch table holds int32 positions (2N to 4N slots, 8 MB for 1M IDs, so it mostly stays in cache) and
    each ID's slot is prefetched ``PD`` IDs ahead, both faster than int64 positions without prefetching.
    Raises ``ValueError`` for N >= 2^31."""
    n = ids.shape[0]
    if n >= 2**31:
        raise ValueError("dedup takes fewer than 2^31 IDs at once")
    size = 1024
    while size < 2 * n:
        size *= 2
    b = 0
    while (1 << b) < size:
        b += 1
    shift = 64 - b
    mask = size - 1
    slot_row = np.full(size, -1, dtype=np.int32)
    uniq = np.empty(n, dtype=np.uint64)
    inverse = np.empty(n, dtype=np.int64)
    u = 0
    for t in range(n):
        if t + PD < n:
            prefetch(slot_row, home(ids[t + PD], shift))
        key = ids[t]
        i = home(key, shift)
        while True:
            r = slot_row[i]
            if r == -1:
                slot_row[i] = u
                uniq[u] = key
                inverse[t] = u
                u += 1
                break
            if uniq[r] == key:
                inverse[t] = r
                break
            i = (i + 1) & mask
    return uniq[:u], inverse


@njit(nogil=True, cache=True)
def segment_sum(ids, grads):
    """Sum the gradient rows of repeated IDs: ``ids: uint64[N]``, ``grads: float32[N, D]`` ->
    (``uint64[U]`` unique IDs in first-seen order, ``float32[U, D]`` summed rows, whether every gradient value
    was finite: checked in the same pass, so a push holding inf or NaN can be refused before anything applies).

    When the IDs are already distinct (an embedding worker's push is deduplicated), ``grads`` itself is returned
    as the summed rows: no copy."""
    uniq, inverse = dedup(ids)
    d = grads.shape[1]
    finite = True
    if uniq.shape[0] == ids.shape[0]:
        bad = 0
        for t in range(ids.shape[0]):
            for j in range(d):
                bad |= not np.isfinite(grads[t, j])
        return uniq, grads, bad == 0
    out = np.zeros((uniq.shape[0], d), dtype=np.float32)
    for t in range(ids.shape[0]):
        u = inverse[t]
        for j in range(d):
            g = grads[t, j]
            if not np.isfinite(g):
                finite = False
            out[u, j] += g
    return uniq, out, finite


@njit(nogil=True, cache=True)
def route(ids, num_shards):
    """Group ``ids: uint64[N]`` by owning shard (``hashing.shard_of``: SplitMix64 finalizer mod num_shards) with
    a counting sort. Returns (``int64[N]`` positions ordered by shard, stable; ``int64[S+1]`` shard bounds)."""
    n = ids.shape[0]
    owner = np.empty(n, dtype=np.int64)
    counts = np.zeros(num_shards + 1, dtype=np.int64)
    for t in range(n):
        z = ids[t]
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        s = np.int64(z % np.uint64(num_shards))
        owner[t] = s
        counts[s + 1] += 1
    bounds = np.cumsum(counts)
    fill = bounds[:-1].copy()
    order = np.empty(n, dtype=np.int64)
    for t in range(n):
        s = owner[t]
        order[fill[s]] = t
        fill[s] += 1
    return order, bounds
