"""Re-sharding: the rows of N shard files re-routed to M shards (``hashing.shard_of``), as shard-file arrays.

A warm start (``persia_core.embedding.warm_start``) and a resume from a checkpoint of another shard count
(``persia_core.train.launcher``) both carry every row, with its optimizer state and recency, to the new shards.
"""

from __future__ import annotations

import numpy as np

from persia_core.embedding.shard_file import TableArrays
from persia_core.embedding.shard_tables import lru_state_dict
from persia_core.hashing import shard_of


def storage_arrays(sd: dict[str, np.ndarray], meta: dict) -> TableArrays:
    """Arrays in recency order (``state_dict`` form) as layout ``storage``: row i is the i-th most recent."""
    n = len(sd["keys"])
    counters = np.zeros(4, np.int64)
    counters[0] = n
    arrays = {k: np.ascontiguousarray(v) for k, v in sd.items()}
    arrays.setdefault("last_used", np.zeros(n, np.int32))
    arrays.update({"lru_rows": np.arange(n - 1, -1, -1, dtype=np.int32), "counters": counters})
    step = int(arrays["last_used"].max()) if n else 0
    return TableArrays(arrays, {**meta, "layout": "storage", "rows": n, "step": max(step, meta.get("step", 0))})


def reshard(
    sources: list[dict[str, TableArrays]], num_shards: int, capacities: dict[str, int] | None = None
) -> tuple[list[dict[str, TableArrays]], dict]:
    """Re-route the rows of N shards to ``num_shards`` shards by ``hashing.shard_of``.

    Every row keeps its weights and optimizer state; recency is merged by each row's relative position in its old
    shard's recency list (most recent first). A new shard holding more rows of a table than ``capacities[table]``
    keeps the most recent ones. Returns (new shards' arrays, ``{"rows": {table: n}, "dropped": {table: n}}``).
    Server bookkeeping (applied pushes) is not carried: it belongs to the old shards' clients."""
    names = sorted({n for s in sources for n in s})
    out: list[dict[str, TableArrays]] = [{} for _ in range(num_shards)]
    report: dict[str, dict[str, int]] = {"rows": {}, "dropped": {}}
    for name in names:
        parts = [lru_state_dict(s[name]) for s in sources if name in s]
        metas = [s[name].meta for s in sources if name in s]
        merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        rank = np.concatenate([np.arange(len(p["keys"])) / max(len(p["keys"]), 1) for p in parts])
        order = np.argsort(rank, kind="stable")
        merged = {k: v[order] for k, v in merged.items()}
        owner = shard_of(merged["keys"], num_shards)
        base = {k: metas[0][k] for k in ("dim", "optimizer") if k in metas[0]}
        base["step"] = max(int(m.get("step", 0)) for m in metas)
        base["dropped_gradients"] = 0
        dropped = 0
        for s in range(num_shards):
            sel = np.flatnonzero(owner == s)
            cap = (capacities or {}).get(name)
            if cap is not None and len(sel) > cap:
                dropped += len(sel) - cap
                sel = sel[:cap]
            out[s][name] = storage_arrays({k: v[sel] for k, v in merged.items()}, base)
        report["rows"][name] = int(len(merged["keys"]) - dropped)
        report["dropped"][name] = int(dropped)
    return out, report
