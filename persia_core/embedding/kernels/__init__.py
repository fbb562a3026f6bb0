"""Compiled inner loops of the embedding table (numba ``@njit(nogil=True, cache=True)``), by concern:

============== ==============================================================================================
module         holds
============== ==============================================================================================
``intrinsics`` software prefetch, 64-byte non-temporal stores, store fence; the prefetch distances
``index``      the hash index, feature ID -> row: probe, batched find, insert, backward-shift delete, rebuild
``recency``    the recency queue behind LRU eviction: enqueue, compaction, least recent row, orderings
``rows``       lookup-or-create with eviction and admission, row gathers, initial rows, expiry, row moves, takes
``optimizers`` SGD, Adagrad, row-wise Adagrad and Adam steps on rows
``grouping``   a batch's IDs: dedup, per-ID gradient sums, routing to shards
``bags``       sum pooling of bags into ``[B, S, D]`` and its backward to one gradient row per unique ID
``linear``     the NN worker's one-output first layer on the pooled embeddings: row dots and their backward
``xxh3``       feature IDs of many keys at once: XXH3-64 of slot prefix + value (``hashing.feature_ids_of_slots``)
``cache``      numba's on-disk cache checked against every file of the package, so that an edit of any module
               recompiles the kernels of the others, which hold compiled copies of its code; imported first
============== ==============================================================================================

The names below are the package's interface (``from persia_core.embedding.kernels import dedup``). Every kernel
releases the GIL, so a parameter server's RPC threads keep (de)serializing while one runs.
"""

from __future__ import annotations

# first, for its effect: each kernel below looks up its cache locator when it is defined
from persia_core.embedding.kernels import cache as cache
from persia_core.embedding.kernels.bags import bag_grads, pool_into
from persia_core.embedding.kernels.grouping import dedup, route, segment_sum
from persia_core.embedding.kernels.index import find_rows, rebuild_index, shift_of
from persia_core.embedding.kernels.linear import row_dots, row_dots_backward
from persia_core.embedding.kernels.optimizers import (
    apply_adagrad,
    apply_adam,
    apply_ftrl,
    apply_rowwise_adagrad,
    apply_sgd,
)
from persia_core.embedding.kernels.recency import (
    first_live,
    list_order,
    newest_first,
    queue_from_order,
    queue_order,
    queue_size,
)
from persia_core.embedding.kernels.rows import (
    apply_moves,
    copy_rows,
    expire,
    gather_rows,
    init_rows,
    lookup,
    take_rows,
)
from persia_core.embedding.kernels.xxh3 import prefixed_xxh3

__all__ = [
    "apply_adagrad",
    "apply_adam",
    "apply_ftrl",
    "apply_moves",
    "apply_rowwise_adagrad",
    "apply_sgd",
    "bag_grads",
    "copy_rows",
    "dedup",
    "expire",
    "find_rows",
    "first_live",
    "gather_rows",
    "init_rows",
    "list_order",
    "lookup",
    "newest_first",
    "prefixed_xxh3",
    "pool_into",
    "queue_from_order",
    "queue_order",
    "queue_size",
    "rebuild_index",
    "route",
    "row_dots",
    "row_dots_backward",
    "segment_sum",
    "shift_of",
    "take_rows",
]
