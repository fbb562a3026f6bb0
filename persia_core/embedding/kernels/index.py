"""Hash index of a table, feature ID -> row (numba kernels): probe, batched find, insert, delete, rebuild.

Linear probing over a power-of-two array ``index: int32[S]`` of row numbers (-1 = empty), keyed by Fibonacci
hashing of the 64-bit feature ID (Knuth, TAOCP vol. 3, 6.4); the IDs themselves are the table's
``keys: uint64[R]`` (row -> ID). Deletion by backward shift (Knuth's Algorithm R), so no tombstones accumulate
under eviction.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_core.embedding.kernels.intrinsics import PF, PR, prefetch

FIB = np.uint64(0x9E3779B97F4A7C15)
EMPTY = np.int32(-1)


@njit(nogil=True, cache=True)
def find_many(ids, index, keys, out):
    """``out[t]`` = row of ``ids[t]`` or -1, for ``ids: uint64[N]``, ``out: int32[N]``.

    Prefetched passes, so that the cache misses of independent IDs overlap: read every ID's home slot (prefetched
    ``PF`` IDs ahead), then check the key of its row (prefetched likewise). The IDs whose home slot holds another
    key (a small share at the index's usual load of 0.6) go on a list that is walked one slot further per round, the
    keys again prefetched ahead, instead of each probing on alone (two misses in a row per step)."""
    shift = shift_of(index)
    mask = index.shape[0] - 1
    n = ids.shape[0]
    for t in range(n):
        if t + PF < n:
            prefetch(index, home(ids[t + PF], shift))
        out[t] = index[home(ids[t], shift)]
    pend_t = np.empty(0, dtype=np.int32)
    pend_i = np.empty(0, dtype=np.int64)
    m = 0
    for t in range(n):
        if t + PF < n and out[t + PF] >= 0:
            prefetch(keys, out[t + PF])
        r = out[t]
        if r < 0 or keys[r] == ids[t]:
            continue  # an empty home slot: absent
        if m == pend_t.shape[0]:
            grown = max(1024, 2 * m)
            pt, pi = np.empty(grown, dtype=np.int32), np.empty(grown, dtype=np.int64)
            pt[:m] = pend_t[:m]
            pi[:m] = pend_i[:m]
            pend_t, pend_i = pt, pi
        pend_t[m] = t
        pend_i[m] = (home(ids[t], shift) + 1) & mask
        m += 1
    while m > 0:
        k = 0
        for j in range(m):
            if j + PR < m:
                ahead = index[pend_i[j + PR]]
                if ahead >= 0:
                    prefetch(keys, ahead)
            t = pend_t[j]
            i = pend_i[j]
            r = index[i]
            if r == -1:
                out[t] = -1
            elif keys[r] == ids[t]:
                out[t] = r
            else:  # still another key: one slot further next round (the list shrinks in place)
                pend_t[k] = t
                pend_i[k] = (i + 1) & mask
                k += 1
        m = k


@njit(nogil=True, cache=True, inline="always")
def home(key, shift):
    """Home slot of ``key: uint64`` in an index of ``2^(64 - shift)`` slots (Fibonacci hashing), as int64."""
    return np.int64((key * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(shift))


@njit(nogil=True, cache=True)
def find(index, keys, shift, key):
    """Row of ``key`` or -1."""
    mask = index.shape[0] - 1
    i = home(key, shift)
    while True:
        r = index[i]
        if r == -1:
            return -1
        if keys[r] == key:
            return r
        i = (i + 1) & mask


@njit(nogil=True, cache=True)
def insert(index, keys, shift, key, row):
    """Put ``row`` (the row of ``key``, which must be absent) into the first empty slot from ``key``'s home on."""
    mask = index.shape[0] - 1
    i = home(key, shift)
    while index[i] != -1:
        i = (i + 1) & mask
    index[i] = row


@njit(nogil=True, cache=True)
def delete(index, keys, shift, key):
    """Remove ``key`` from the index by backward-shift deletion. Returns True if it was present."""
    mask = index.shape[0] - 1
    i = home(key, shift)
    while True:
        r = index[i]
        if r == -1:
            return False
        if keys[r] == key:
            break
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        r = index[j]
        if r == -1:
            break
        k = home(keys[r], shift)
        # move r back to i when its home k is not cyclically in (i, j]
        if (j > i and (k <= i or k > j)) or (j < i and (k <= i and k > j)):
            index[i] = r
            i = j
    index[i] = -1
    return True


@njit(nogil=True, cache=True)
def rebuild_index(index, keys, shift, size):
    """Re-insert rows ``0..size-1`` into an all-empty ``index``."""
    index[:] = -1
    for r in range(size):
        if r + PF < size:
            prefetch(index, home(keys[r + PF], shift))
        insert(index, keys, shift, keys[r], r)


@njit(nogil=True, cache=True)
def slot_of(index, keys, shift, key):
    """Index slot holding ``key`` (which must be present)."""
    mask = index.shape[0] - 1
    i = home(key, shift)
    while keys[index[i]] != key:
        i = (i + 1) & mask
    return i


@njit(nogil=True, cache=True, inline="always")
def shift_of(index):
    # 64 - log2(len(index)); len is a power of two
    n = index.shape[0]
    b = 0
    while (1 << b) < n:
        b += 1
    return 64 - b


@njit(nogil=True, cache=True)
def find_rows(ids, index, keys):
    """Row of each ID (int32[N], -1 where absent)."""
    out = np.empty(ids.shape[0], dtype=np.int32)
    find_many(ids, index, keys, out)
    return out
