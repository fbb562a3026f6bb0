"""Resuming a local training run from a checkpoint: the state each parameter server starts from, re-sharded
when the checkpoint has another shard count than the run (``persia_core.embedding.plan.reshard``).
"""

from __future__ import annotations

import json
import logging
import os

from persia_core import io
from persia_core.checkpoints import CheckpointError
from persia_core.config import RunConfig
from persia_core.embedding.reshard import reshard
from persia_core.embedding.shard_file import read_shard_file, write_shard_arrays
from persia_core.memory import capacity_for_budget
from persia_core.model_store import shard_file_name

log = logging.getLogger("persia.launcher")


def shard_capacities(config: RunConfig, plan_path: str) -> dict[str, int]:
    """Rows per shard of each table: from the shard plan at ``plan_path`` where there is one, else what
    ``embedding.shard_memory_bytes`` holds, split over the tables by ``table_budgets``."""
    if plan_path and io.exists(plan_path):
        plan = json.loads(io.read_text(plan_path))
        return {n: int(t["capacity_rows_per_shard"]) for n, t in plan["tables"].items()}
    emb = config.embedding
    budgets = emb.table_budgets()
    return {t.name: capacity_for_budget(budgets[t.name], t.optimizer.name, t.dim, emb.storage) for t in emb.tables}


def checkpoint_inits(
    ckpt_path: str, manifest: dict, n: int, config: RunConfig, plan_path: str, work_dir: str
) -> list[dict]:
    """The state each of the ``n`` servers starts from: the checkpoint's shard files (checked by the servers as
    they load them), or, for a checkpoint of another shard count, its rows re-sharded into ``work_dir``."""
    shards = sorted((e for e in manifest["files"] if e.get("role") == "shard"), key=lambda e: e["shard"])
    if len(shards) == n:
        return [{"path": io.join(ckpt_path, e["path"]), "bytes": e["bytes"], "crc32c": e["crc32c"]} for e in shards]
    log.info("re-sharding %s from %d to %d shards", ckpt_path, len(shards), n)
    try:
        sources = [
            read_shard_file(io.join(ckpt_path, e["path"]), e["bytes"], e["crc32c"], build_index=False).tables
            for e in shards
        ]
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    out, report = reshard(sources, n, shard_capacities(config, plan_path))
    inits = []
    for s, tables in enumerate(out):
        path = os.path.join(work_dir, "resharded", shard_file_name(s))
        nbytes, crc = write_shard_arrays(path, tables, fsync=False)
        inits.append({"path": path, "bytes": nbytes, "crc32c": crc})
    log.info("re-sharded rows per table: %s (dropped beyond capacity: %s)", report["rows"], report["dropped"])
    return inits
