"""Routing of feature IDs to shards, shared by the in-process backend and the parameter-server client."""

from __future__ import annotations

import numpy as np

from persia_core.embedding import kernels as K


def positions_by_shard(ids: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Positions in ``ids: uint64[N]`` owned by each shard (``hashing.shard_of``), as ``num_shards`` int64
    arrays, each in increasing order (compiled counting sort, ``kernels.route``)."""
    order, bounds = K.route(np.ascontiguousarray(ids, dtype=np.uint64), num_shards)
    return [order[bounds[s] : bounds[s + 1]] for s in range(num_shards)]


def group_by_shard(uniq: np.ndarray, inverse: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reorder a batch's distinct IDs so that each shard's are contiguous, in their order within ``uniq``.

    ``uniq: uint64[U]``, ``inverse: int64[N]`` (position in ``uniq`` of each of the batch's IDs). Returns
    ``(uint64[U] grouped IDs, int64[N] positions in them, int64[S+1] bounds)``: shard ``s`` owns
    ``grouped[bounds[s]:bounds[s+1]]``. A backend given the bounds (``shard_parts``) sends slices instead of
    routing the IDs again at every lookup and push of the batch; each shard gets the same IDs in the same order."""
    if num_shards == 1:  # one shard owns them all: nothing to reorder
        return uniq, inverse, np.array([0, len(uniq)], dtype=np.int64)
    order, bounds = K.route(np.ascontiguousarray(uniq, dtype=np.uint64), num_shards)
    rank = np.empty(len(order), dtype=np.int64)
    np.put(rank, order, np.arange(len(order), dtype=np.int64))
    return np.take(uniq, order), np.take(rank, inverse), bounds


def shard_parts(ids: np.ndarray, num_shards: int, bounds: np.ndarray | None = None) -> list[np.ndarray | slice]:
    """Where each shard's IDs are in ``ids: uint64[U]``: ``positions_by_shard``, or the slices
    ``bounds[s]:bounds[s+1]`` when ``ids`` are grouped by shard (``group_by_shard``; no routing pass). Raises
    ``ValueError`` when ``bounds`` do not fit ``num_shards`` and ``ids``."""
    if bounds is None:
        return list(positions_by_shard(ids, num_shards))
    if len(bounds) != num_shards + 1 or bounds[0] != 0 or bounds[-1] != len(ids):
        raise ValueError(f"shard bounds {list(bounds)} do not fit {len(ids)} IDs over {num_shards} shards")
    return [slice(int(bounds[s]), int(bounds[s + 1])) for s in range(num_shards)]


def part_size(part: np.ndarray | slice) -> int:
    """Number of IDs of one shard's part (``shard_parts``)."""
    return part.stop - part.start if isinstance(part, slice) else len(part)


def take_part(a: np.ndarray, part: np.ndarray | slice) -> np.ndarray:
    """The rows of ``a`` of one shard's part: a view for a slice, a gathered copy (``np.take``) for positions."""
    return a[part] if isinstance(part, slice) else np.take(a, part, axis=0)
