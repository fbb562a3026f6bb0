"""Embedding tables' slot layout and per-table ID deduplication (no torch: an embedding-worker process needs
only these). Sum pooling on torch tensors is ``persia_core.embedding.pooling``'s; the compiled pooling into
``[B, S, D]`` and its backward are ``kernels.pool_into`` and ``kernels.bag_grads``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from persia_core.config import WIDE_TABLE, RunConfig
from persia_core.embedding.kernels import dedup
from persia_core.embedding.routing import group_by_shard
from persia_core.sparse import IdBatch


@dataclass
class TableLayout:
    """The slots of one embedding table, in model order."""

    name: str
    dim: int
    slots: list[str]


def table_layouts(config: RunConfig) -> list[TableLayout]:
    """Tables in config order, each with its slots in config order; slot order fed to the model is the
    concatenation. Raises ``ValueError`` if tables have different dims (the models need one D)."""
    out = [
        TableLayout(t.name, t.dim, [s.name for s in config.slots if s.table == t.name]) for t in config.embedding.tables
    ]
    out = [t for t in out if t.slots]
    if len({t.dim for t in out}) > 1:
        raise ValueError("embedding.tables: the dense models need one embedding dim across tables used by slots")
    return out


def wide_layout(config: RunConfig) -> TableLayout | None:
    """The wide table (``model.wide``) over every slot in model order (``float32[B, S, 1]`` pooled), or None."""
    return TableLayout(WIDE_TABLE, 1, model_slot_order(config)) if config.model.wide else None


def prepare_wide(ids: IdBatch, wide: TableLayout, prepared: dict[str, PreparedIds], num_shards: int = 0) -> PreparedIds:
    """The wide table's IDs of a batch: every slot's, deduplicated; those of the one deep table when it holds
    every slot (no second dedup). ``num_shards``: as ``prepare_ids``'s."""
    if len(prepared) == 1:
        only = next(iter(prepared.values()))
        if len(only.offsets) == len(wide.slots) * ids.batch_size + 1:
            return only
    return prepare_ids(ids, [wide], num_shards)[wide.name]


def model_slot_order(config: RunConfig) -> list[str]:
    """Slot names in the order the model sees them ([B, S, D] axis 1)."""
    return [s for t in table_layouts(config) for s in t.slots]


@dataclass
class PreparedIds:
    """The IDs of one table for one batch, deduplicated.

    uniq: ``uint64[U]`` unique IDs; inverse: ``int64[N]`` position of each ID in ``uniq``;
    offsets: ``int64[S_t*B + 1]`` bag offsets over the ``N`` IDs (bag ``s*B + b``)."""

    uniq: np.ndarray
    inverse: np.ndarray
    offsets: np.ndarray
    one_per_bag: bool = False
    """Every bag holds exactly one ID (Criteo's categorical slots): pooling is then a plain row gather."""
    bounds: np.ndarray | None = None
    """``int64[S+1]``: ``uniq`` is grouped by parameter-server shard, shard s's IDs at ``bounds[s]:bounds[s+1]``
    (``routing.group_by_shard``), or None."""


def prepare_ids(ids: IdBatch, layouts: list[TableLayout], num_shards: int = 0) -> dict[str, PreparedIds]:
    """Split a batch's IDs by table and deduplicate each (compiled O(N) hash dedup, releases the GIL); with
    ``num_shards`` >= 1, each table's distinct IDs grouped by the shard that owns them (``bounds``), so that its
    lookup and push send slices (``routing.group_by_shard``)."""
    out = {}
    for t in layouts:
        sub = ids.select_slots(t.slots) if len(layouts) > 1 or ids.keys != t.slots else ids
        uniq, inverse = dedup(sub.values)
        bounds = None
        if num_shards >= 1:
            uniq, inverse, bounds = group_by_shard(uniq, inverse, num_shards)
        bags = len(sub.offsets) - 1
        one = len(sub.values) == bags and bool((sub.offsets[1:] > sub.offsets[:-1]).all())
        out[t.name] = PreparedIds(uniq, inverse, sub.offsets, one, bounds)
    return out
