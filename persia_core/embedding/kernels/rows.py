"""A table's rows (numba kernels): batched lookup-or-create with LRU eviction and feature admission, row
gathers, deterministic initial rows, and expiry of idle rows.

A lookup finds rows in the hash index (``kernels.index``), records their recency in the recency queue
(``kernels.recency``) and copies them into the output; an unseen ID takes a free row or evicts the least recently
used one. Expiry removes rows by age and keeps the remaining rows contiguous; ``apply_moves`` then moves the
per-row arrays the same way.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_core.embedding.kernels.index import delete, find, find_many, home, insert, shift_of, slot_of
from persia_core.embedding.kernels.intrinsics import PL, prefetch, store_fence, stream64
from persia_core.embedding.kernels.recency import DEAD, enqueue_many, first_live


@njit(nogil=True, cache=True)
def _splitmix(x):
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(nogil=True, cache=True)
def init_row(key, seed, scale, out):
    """Deterministic initial row of ``key``: ``out[j] = scale * (2u - 1)``, u in [0, 1) from SplitMix64 of
    (key, seed, j). The same ID gets the same row on any shard, process or run."""
    state = key ^ (np.uint64(seed) * np.uint64(0xD1B54A32D192ED03))
    for j in range(out.shape[0]):
        state = _splitmix(state)
        u = np.float64(state >> np.uint64(11)) * (1.0 / 9007199254740992.0)
        out[j] = np.float32(scale * (2.0 * u - 1.0))


@njit(nogil=True, cache=True, inline="always")
def _put_row(out, t, weights, r, stream):
    """``out[t] = weights[r]`` (float32 rows); ``stream``: with 64-byte non-temporal stores (see ``gather_rows``)."""
    if stream:
        for c in range(out.shape[1] // 16):
            stream64(out, t, weights, r, c)
    else:
        for j in range(out.shape[1]):  # an element loop: a slice assignment builds two array views per row
            out[t, j] = weights[r, j]


@njit(nogil=True, cache=True, inline="always")
def _touch(last_used, r, step, touched, nt):
    """``last_used[r] = step``; on the row's first touch in this step, ``touched[nt] = r`` and returns nt + 1.
    Branch-free: whether a row is touched first here is a coin toss for the branch predictor."""
    first = last_used[r] != step
    last_used[r] = step
    touched[nt] = r
    return nt + np.int64(first)


@njit(nogil=True, cache=True)
def _touch_and_copy(rows, last_used, step, touched, weights, out, fill, stream):
    """For each found row ``rows[t] >= 0`` (``rows: int32[N]``): mark it used at ``step`` (``_touch``, its first
    touches listed in ``touched: int32[N]`` in batch order) and, if ``fill``, copy it into ``out[t]``
    (``out: float32[N, D]``, ``stream`` as in ``gather_rows``). Returns how many rows were first touched.

    One pass, ``last_used`` and (if ``fill``) the row's first cache line both prefetched ``PL`` rows ahead, so that
    their misses overlap: faster than a recency pass and a copy pass of their own. One loop per (``fill``,
    ``stream``), each with them constant: with the two tested inside one loop, the fused pass gained nothing. Also
    tried and dropped, as slower or no faster: the probe's key check in this pass too (the IDs found off their
    home slot then need an ordered merge into the recency queue), keys and ``last_used`` interleaved in one array,
    prefetching to L2 instead of L1."""
    if fill and stream:
        return _touch_and_copy_rows(rows, last_used, step, touched, weights, out, True)
    if fill:
        return _touch_and_copy_rows(rows, last_used, step, touched, weights, out, False)
    n = rows.shape[0]
    nt = 0
    for t in range(n):
        if t + PL < n and rows[t + PL] >= 0:
            prefetch(last_used, rows[t + PL])
        r = rows[t]
        if r >= 0:
            nt = _touch(last_used, r, step, touched, nt)
    return nt


@njit(nogil=True, cache=True, inline="always")
def _touch_and_copy_rows(rows, last_used, step, touched, weights, out, stream):
    """``_touch_and_copy`` with ``fill``; inlined where ``stream`` is a constant, so that each copy of the loop
    tests nothing per row."""
    n = rows.shape[0]
    nt = 0
    for t in range(n):
        if t + PL < n:
            ahead = rows[t + PL]
            if ahead >= 0:
                prefetch(last_used, ahead)
                prefetch(weights, ahead)
        r = rows[t]
        if r >= 0:
            nt = _touch(last_used, r, step, touched, nt)
            _put_row(out, t, weights, r, stream)
    return nt


@njit(nogil=True, cache=True)
def lookup(
    ids,
    create,
    index,
    keys,
    weights,
    qrow,
    qstep,
    qht,
    counters,
    capacity,
    step,
    last_used,
    seed,
    scale,
    out,
    admit_prob,
    admit_after,
    sketch,
    refused,
    fill,
    rows,
    stream,
    evicted,
    n_evicted,
):
    """Batched lookup(-or-create) of ``ids: uint64[N]`` into ``out: float32[N, D]``.

    create=True: an unseen ID gets a row (deterministic init, state reset); when the table is full the least
    recently used row is evicted first (its key removed from the index). create=False: unseen -> zero row and
    nothing is inserted. A found row gets ``last_used = step`` and a recency-queue entry on its first touch in
    this batch (``last_used != step``).
    ``counters``: int64[4] = [size, evictions, inserts, misses]. Returns the rows created (``int32[n]``),
    whose optimizer state the caller resets; ``rows: int32[N]`` receives each ID's row (-1: none).
    ``fill=False`` (16-bit storage): neither initialize created rows nor copy rows into ``out``; the caller
    does both from ``rows`` (``weights`` is then unused). ``stream``: as in ``gather_rows``.
    ``evicted: uint64[C]``, ``n_evicted: int64[1]``: the key of each evicted row is written at
    ``evicted[n_evicted[0]]`` and the count advanced (a log of evictions for incremental export); the caller leaves
    room for N more, or passes ``C = 0`` for no log.

    Feature admission (PERSIA's ``admit_probability``; sightings as in count-based admission): an unseen ID
    gets a row only if ``admit_after == 0`` or it has now been seen ``admit_after`` times (counted in ``sketch``,
    uint8 counters indexed by a hash of the ID: a one-row count-min sketch, so it may admit early on a collision,
    never late), and with probability ``admit_prob`` (a hash of ID and step, so reproducible). A refused ID reads
    the zero row and is counted in ``refused[0]``.

    Three passes, so that the cache misses of independent IDs overlap (each prefetched): probe all
    (``find_many``); update the recency of the rows found and copy them into ``out`` (``_touch_and_copy``);
    create the rows of unseen IDs in batch order, copying each at once. Recency is set before any row is created,
    so that rows of this batch are never the least recent when a new row evicts (and rows already copied stay
    valid).
    """
    shift = shift_of(index)
    sketch_shift = 64 - _log2(sketch.shape[0])
    n = ids.shape[0]
    d = out.shape[1]
    find_many(ids, index, keys, rows)
    created = np.empty(n, dtype=np.int32)  # first the rows touched (queued in one go), then the rows created
    nt = _touch_and_copy(rows, last_used, step, created, weights, out, fill, stream)
    enqueue_many(qrow, qstep, qht, last_used, counters[0], created, nt, step)
    nc = 0
    for t in range(n):
        if rows[t] != -1:
            continue
        key = ids[t]
        r = find(index, keys, shift, key)  # a repeat of an ID created earlier in this batch
        if r == -1:
            if not create:
                counters[3] += 1
            elif admit_after > 0 and not _admitted_after(sketch, sketch_shift, key, admit_after):
                refused[0] += 1
            elif admit_prob < 1.0 and not _admitted_by_chance(key, step, admit_prob):
                refused[0] += 1
            else:
                r = _create(
                    index, keys, shift, qrow, qstep, qht, counters, capacity, step, last_used, key, evicted, n_evicted
                )
                if fill:
                    init_row(key, seed, scale, weights[r])
                created[nc] = r
                nc += 1
        rows[t] = r
        if fill:
            if r >= 0:
                _put_row(out, t, weights, r, stream)
            else:
                for j in range(d):
                    out[t, j] = 0.0
    # queued after all evictions of this batch: a row created now must not be taken back by one of them (the
    # head never reaches these entries before the batch ends, exactly as if each had been queued at once)
    enqueue_many(qrow, qstep, qht, last_used, counters[0], created, nc, step)
    if fill and stream:
        store_fence()
    return created[:nc]


@njit(nogil=True, cache=True, inline="always")
def _admitted_after(sketch, sketch_shift, key, admit_after):
    """Count a sighting of ``key`` in the admission sketch; whether it has now been seen ``admit_after`` times."""
    h = home(key ^ np.uint64(0x5851F42D4C957F2D), sketch_shift)
    c = sketch[h]
    if c < 255:
        sketch[h] = c + 1
    return c + 1 >= admit_after


@njit(nogil=True, cache=True, inline="always")
def _admitted_by_chance(key, step, admit_prob):
    """Whether ``key`` is admitted at ``step`` with probability ``admit_prob`` (a hash of both: reproducible)."""
    u = np.float64(_splitmix(key ^ (np.uint64(step) * np.uint64(0xD6E8FEB86659FD93))) >> np.uint64(11))
    return u * (1.0 / 9007199254740992.0) < admit_prob


@njit(nogil=True, cache=True)
def _create(index, keys, shift, qrow, qstep, qht, counters, capacity, step, last_used, key, evicted, n_evicted):
    """A row for the unseen ``key``: the next free row, or at capacity the least recently used row, evicted (its key
    removed from the index and, where ``evicted`` has room, logged in it: see ``lookup``). The row gets ``key``, an
    index entry and ``last_used = step``; the caller initializes it and queues it. Raises ``ValueError`` when no row
    can be taken: the least recent row was itself used in this step, or the recency queue holds no live row (a batch
    of more distinct IDs than the capacity)."""
    size = counters[0]
    if size < capacity:
        r = np.int32(size)
        counters[0] = size + 1
    else:
        r = first_live(qrow, qstep, qht, last_used)  # the least recently used row
        if r < 0 or last_used[r] == step:
            raise ValueError("a batch holds more distinct IDs than the table's row capacity")
        qht[0] += 1
        delete(index, keys, shift, keys[r])
        counters[1] += 1
        if n_evicted[0] < evicted.shape[0]:
            evicted[n_evicted[0]] = keys[r]
            n_evicted[0] += 1
    keys[r] = key
    insert(index, keys, shift, key, r)
    counters[2] += 1
    last_used[r] = step
    return r


@njit(nogil=True, cache=True)
def gather_rows(weights, rows, out, stream):
    """``out[t] = weights[rows[t]]`` (zeros where ``rows[t] < 0``) for ``weights: float32[R, D]``,
    ``rows: int32[N]``, ``out: float32[N, D]``; rows prefetched ``PL`` ahead.

    ``stream=True`` (only when ``out`` starts on a 64-byte boundary and ``D`` is a multiple of 16): rows are written
    with 64-byte non-temporal stores, so the output (64 MB for 1M IDs at dim 16, far beyond the caches) is not
    first read into the cache only to be overwritten; a store fence ends the pass."""
    n = rows.shape[0]
    d = out.shape[1]
    for t in range(n):
        if t + PL < n and rows[t + PL] >= 0:
            prefetch(weights, rows[t + PL])
        r = rows[t]
        if r >= 0:
            _put_row(out, t, weights, r, stream)
        else:
            for j in range(d):
                out[t, j] = 0.0
    if stream:
        store_fence()


@njit(nogil=True, cache=True)
def init_rows(keys, seed, scale, dim):
    """Initial rows of ``keys: uint64[n]`` (``init_row`` each) as ``float32[n, dim]``."""
    out = np.empty((keys.shape[0], dim), dtype=np.float32)
    for i in range(keys.shape[0]):
        init_row(keys[i], seed, scale, out[i])
    return out


@njit(nogil=True, cache=True, inline="always")
def _log2(n):
    b = 0
    while (1 << b) < n:
        b += 1
    return b


@njit(nogil=True, cache=True)
def expire(older_than, index, keys, qrow, qstep, qht, counters, last_used):
    """Remove every row whose ``last_used`` step is below ``older_than``; returns (how many, moves, their keys
    ``uint64[how many]``).

    They are the live entries at the head of the recency queue. Rows stay contiguous: each freed row below the
    new size takes a surviving row from above it. Callers must move the per-row weights and optimizer state the
    same way (``moves``: int64[M, 2] pairs (from, to), each row moved at most once)."""
    shift = shift_of(index)
    size = counters[0]
    gone = np.empty(size, dtype=np.int32)
    gone_keys = np.empty(size, dtype=np.uint64)
    ne = 0
    q = qrow.shape[0]
    while True:
        r = first_live(qrow, qstep, qht, last_used)
        if r < 0 or last_used[r] >= older_than:
            break
        qht[0] += 1
        gone_keys[ne] = keys[r]
        delete(index, keys, shift, keys[r])
        last_used[r] = DEAD
        gone[ne] = r
        ne += 1
    new_size = size - ne
    moves = np.empty((ne, 2), dtype=np.int64)
    remap = np.full(ne, -1, dtype=np.int32)  # row new_size + i -> where it moved
    nm = 0
    src = size - 1
    for i in range(ne):
        h = gone[i]
        if h >= new_size:
            continue
        while last_used[src] == DEAD:
            src -= 1
        index[slot_of(index, keys, shift, keys[src])] = h
        keys[h] = keys[src]
        last_used[h] = last_used[src]
        last_used[src] = DEAD
        moves[nm, 0] = src
        moves[nm, 1] = h
        remap[src - new_size] = h
        nm += 1
        src -= 1
    counters[0] = new_size
    if ne:  # rewrite the queue: moved rows under their new numbers, removed rows' entries dropped
        w = qht[0]
        for i in range(qht[0], qht[1]):
            p = i % q
            r = qrow[p]
            if r >= new_size:
                r = remap[r - new_size] if r - new_size < ne else -1
            if r >= 0 and last_used[r] == qstep[p]:
                o = w % q
                qrow[o] = r
                qstep[o] = qstep[p]
                w += 1
        qht[1] = w
    return ne, moves[:nm], gone_keys[:ne]


@njit(nogil=True, cache=True)
def apply_moves(moves, arr):
    """Copy ``arr[from]`` to ``arr[to]`` for each (from, to) row of ``moves: int64[M, 2]``, in order."""
    for i in range(moves.shape[0]):
        arr[moves[i, 1]] = arr[moves[i, 0]]


@njit(nogil=True, cache=True)
def take_rows(src, rows, dst):
    """``dst[t] = src[rows[t]]`` for ``src: T[R, W]``, ``rows: int64[N]`` (each in ``[0, R)``), ``dst: T[N, W]``,
    any dtype T: ``np.take`` along rows without holding the GIL (a delta applied beside serving)."""
    w = src.shape[1]
    for t in range(rows.shape[0]):
        r = rows[t]
        for j in range(w):
            dst[t, j] = src[r, j]


@njit(nogil=True, cache=True)
def copy_rows(src, dst):
    """``dst[t] = src[t]`` for ``src, dst: T[N, W]``, any dtype T: a copy without holding the GIL (numpy's
    assignment holds it; a server builds tables beside its requests)."""
    w = src.shape[1]
    for t in range(src.shape[0]):
        for j in range(w):
            dst[t, j] = src[t, j]
