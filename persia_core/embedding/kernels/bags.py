"""Sum pooling of a batch's bags into ``[B, S, D]`` and its backward, per unique ID (numba kernels).

An embedding worker pools the rows it looked up and hands the NN worker only the pooled ``float32[B, S, D]``; the
NN worker hands back the gradient with respect to it, which ``bag_grads`` turns into one gradient row per unique
ID (what a parameter server applies). Bags are slot-major, as in ``persia_core.sparse.IdBatch``: for table slot
``s`` and example ``i``, bag ``s*B + i`` holds positions ``offsets[s*B + i] .. offsets[s*B + i + 1] - 1`` of
``inverse``, each the row (among the batch's unique IDs) of one ID. An empty bag pools to exact zeros and sends no
gradient. Sums run in float32 in bag order, as ``torch.nn.functional.embedding_bag(mode="sum")`` on the CPU does.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_core.embedding.kernels.intrinsics import PB, PG, prefetch


@njit(nogil=True, cache=True)
def _check(num_rows, dim, inverse, offsets, num_slots, batch, buf, slot0):
    if offsets.shape[0] != num_slots * batch + 1:
        raise ValueError("offsets must hold num_slots * batch + 1 entries")
    if buf.shape[0] < batch or buf.shape[1] < slot0 + num_slots or buf.shape[2] != dim or slot0 < 0:
        raise ValueError("the [B, S, D] buffer is too small for this table's slots, or its D differs")
    if offsets[0] != 0 or offsets[offsets.shape[0] - 1] > inverse.shape[0]:
        raise ValueError("offsets must start at 0 and end within inverse")
    for k in range(offsets[offsets.shape[0] - 1]):
        if inverse[k] < 0 or inverse[k] >= num_rows:
            raise ValueError("a row index in inverse is out of range")


@njit(nogil=True, cache=True)
def pool_into(rows, inverse, offsets, num_slots, batch, out, slot0):
    """Sum-pool one table's bags into ``out[:batch, slot0 : slot0 + num_slots, :]`` in place.

    ``rows: float32[U, D]``, ``inverse: int64[N]`` (row of each ID), ``offsets: int64[num_slots*batch + 1]``,
    ``out: float32[B', S, D]`` (``B' >= batch``; rows past ``batch`` are left alone). Raises ``ValueError`` when the
    shapes disagree or an index is out of range.

    Example by example, so that ``out`` is written in memory order, and the first row of the bag ``PB`` examples
    ahead is prefetched (the rows are random accesses): about twice as fast as bag order, with the same sums."""
    d = rows.shape[1]
    _check(rows.shape[0], d, inverse, offsets, num_slots, batch, out, slot0)
    n = inverse.shape[0]
    for i in range(batch):
        for s in range(num_slots):
            bag = s * batch + i
            if i + PB < batch:
                ahead = offsets[bag + PB]
                if ahead < n:
                    prefetch(rows, inverse[ahead])
            dst = out[i, slot0 + s]
            for j in range(d):
                dst[j] = 0.0
            for k in range(offsets[bag], offsets[bag + 1]):
                src = rows[inverse[k]]
                for j in range(d):
                    dst[j] += src[j]


@njit(nogil=True, cache=True)
def bag_grads(grad, inverse, offsets, num_slots, batch, slot0, num_rows, scale):
    """The backward of ``pool_into``: per unique ID, ``scale`` times the sum of the gradients of the bags holding it.

    ``grad: float32[B', S, D]`` (the gradient of the loss with respect to the pooled buffer), ``inverse``,
    ``offsets``, ``num_slots``, ``batch``, ``slot0`` as given to ``pool_into``, ``num_rows``: U. Returns
    ``(float32[U, D], whether every value read was finite)``; an ID in no bag gets a zero row. Raises ``ValueError``
    as ``pool_into`` does."""
    d = grad.shape[2]
    _check(num_rows, d, inverse, offsets, num_slots, batch, grad, slot0)
    out = np.zeros((num_rows, d), dtype=np.float32)
    bad = 0
    n = inverse.shape[0]
    for s in range(num_slots):
        for i in range(batch):
            lo, hi = offsets[s * batch + i], offsets[s * batch + i + 1]
            if lo == hi:
                continue
            if hi + PG < n:  # bags are visited in ID order: the row PG IDs ahead
                prefetch(out, inverse[hi + PG])
            g = grad[i, slot0 + s]
            for j in range(d):
                bad |= not np.isfinite(g[j])
            for k in range(lo, hi):
                dst = out[inverse[k]]
                for j in range(d):
                    dst[j] += g[j]
    if scale != 1.0:  # after the sums, as the NN worker's (sum of bag gradients) / M was
        sc = np.float32(scale)
        for r in range(num_rows):
            for j in range(d):
                out[r, j] *= sc
    return out, bad == 0
