"""Routing of feature IDs to shards, shared by the in-process backend and the parameter-server client."""

from __future__ import annotations

import numpy as np

from persia_core.embedding import kernels as K


def positions_by_shard(ids: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Positions in ``ids: uint64[N]`` owned by each shard (``hashing.shard_of``), as ``num_shards`` int64
    arrays, each in increasing order (compiled counting sort, ``kernels.route``)."""
    order, bounds = K.route(np.ascontiguousarray(ids, dtype=np.uint64), num_shards)
    return [order[bounds[s] : bounds[s + 1]] for s in range(num_shards)]
