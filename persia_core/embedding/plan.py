"""Shard plan and initial state of the embedding parameter servers (the ``init_shards`` step).

From the preprocess statistics (distinct IDs per slot) and the embedding settings, decide each shard's row
capacity per table from its memory budget, estimate the memory the run needs, refuse a plan that does not fit
(unless ``embedding.evict_at_capacity``: the estimate is then the capacity, and the tables evict), and write the
initial state of every shard: empty tables (cold start: rows are created on first lookup with the deterministic
per-ID initializer), or the rows and optimizer state of a previous run's model (warm start,
``persia_core.embedding.warm_start``).

Output folder::

    shard_plan.json         routing rule, shards, per table: dim, optimizer, bytes/row, capacity, estimates;
                            ``warm_start``: where from (and ``manifest_digest``), rows carried over and dropped
    shards/shard-SSSSS.npz  initial state of each shard
    warm_start/dense.pt     the previous model's dense weights (warm start only)
    run_config.yaml         the run config, passed on to training
"""

from __future__ import annotations

import json
import math

from persia_core import io
from persia_core.config import RunConfig
from persia_core.data.reader import read_schema
from persia_core.embedding.shard_tables import make_tables, shard_file_bytes
from persia_core.embedding.warm_start import resolve_warm_start, warm_start
from persia_core.memory import bytes_per_row, capacity_for_budget
from persia_core.model_store import folder_digest, shard_file_name

ROUTING = "shard = splitmix64(feature_id) % num_shards"
SKEW_MARGIN = 1.2
"""Rows of the fullest shard over the mean, allowed for in the estimate (hash routing is close to uniform)."""


class PlanError(ValueError):
    """The embedding tables do not fit the shards' memory budget; the message gives both figures."""


def make_plan(config: RunConfig, schema: dict) -> dict:
    """The shard plan (see module docstring) as a dict. Raises ``PlanError`` when the estimate exceeds the
    budget of a shard."""
    emb = config.embedding
    n = emb.num_shards
    budgets = emb.table_budgets()
    distinct = schema.get("distinct_ids", {})
    tables = {}
    total_est = 0
    for t in emb.tables:
        slots = config.table_slots(t.name)
        ids = sum(int(distinct.get(s, 0)) for s in slots)
        per_shard = int(math.ceil(ids / n * SKEW_MARGIN)) if ids else 0
        cap = capacity_for_budget(budgets[t.name], t.optimizer.name, t.dim, emb.storage)
        bpr = bytes_per_row(t.optimizer.name, t.dim, cap, emb.storage)
        evicts = per_shard > cap and emb.evict_at_capacity
        if evicts:
            per_shard = cap
        est = int(per_shard * bpr)
        total_est += est
        tables[t.name] = {
            "dim": t.dim,
            "optimizer": t.optimizer.name,
            "bytes_per_row": bpr,
            "capacity_rows_per_shard": cap,
            "estimated_ids": ids,
            "estimated_rows_per_shard": per_shard,
            "estimated_bytes_per_shard": est,
            "evicts": evicts,
            "slots": slots,
        }
        if per_shard > cap:
            raise PlanError(
                f"embedding table {t.name!r}: ~{ids} distinct IDs need ~{per_shard} rows per shard "
                f"(~{est} bytes at {bpr:.1f} bytes/row) on {n} shards, but a shard's budget of "
                f"{emb.shard_memory_bytes} bytes (embedding.shard_memory_bytes) holds {cap}; "
                f"raise the budget or embedding.num_shards, or set embedding.evict_at_capacity to evict the least "
                f"recently used rows at capacity"
            )
    return {
        "routing": ROUTING,
        "num_shards": n,
        "shard_memory_bytes": emb.shard_memory_bytes,
        "evict_at_capacity": emb.evict_at_capacity,
        "estimated_bytes_per_shard": total_est,
        "estimated_bytes_total": total_est * n,
        "tables": tables,
    }


def init_shards(config: RunConfig, data_dir: str, output_dir: str, warm_start_from: str = "") -> dict:
    """Write the shard plan, run config and initial shard states to ``output_dir``. Returns the plan.

    ``warm_start_from``: see ``warm_start.resolve_warm_start`` ("" = cold start). Raises ``FileNotFoundError`` when
    ``data_dir`` has no ``schema.json`` or ``warm_start_from`` names nothing usable, ``PlanError`` when the plan
    does not fit the memory budget, ``WarmStartError`` when the previous model does not match the config."""
    schema = read_schema(data_dir)
    plan = make_plan(config, schema)
    caps = {name: t["capacity_rows_per_shard"] for name, t in plan["tables"].items()}
    source = resolve_warm_start(warm_start_from)
    if source:
        plan["warm_start"] = warm_start(config, schema, source, output_dir, caps)
        files = plan["warm_start"].pop("shard_files")
        # the deltas of this run apply to that model: they name it (``embedding.delta``, ``persia serve --deltas``)
        plan["warm_start"]["manifest_digest"] = folder_digest(source)
    else:
        files = []
        for s in range(plan["num_shards"]):
            tables = make_tables(
                config.embedding.tables,
                config.embedding.shard_memory_bytes,
                config.trainer.seed,
                capacities=caps,
                storage=config.embedding.storage,
            )
            rel = shard_file_name(s)
            io.write_bytes(io.join(output_dir, rel), shard_file_bytes(tables))
            files.append(rel)
        if warm_start_from:
            plan["warm_start"] = {"from": warm_start_from, "cold_start": "no model blessed there yet"}
    plan["shard_files"] = files
    io.write_text(io.join(output_dir, "shard_plan.json"), json.dumps(plan, indent=1))
    io.write_text(io.join(output_dir, "run_config.yaml"), config.to_yaml())
    return plan
