"""Shard plan and initial state of the embedding parameter servers (the ``init_shards`` step).

From the preprocess statistics (distinct IDs per slot) and the embedding settings, decide each shard's row
capacity per table from its memory budget, estimate the memory the run needs, refuse a plan that does not fit,
and write the initial state of every shard: empty tables (cold start: rows are created on first lookup with the
deterministic per-ID initializer), or the rows and optimizer state of a previous run's model (warm start).

Warm start (recurring retraining): ``warm_start_from`` names the previous run's Model artifact, a checkpoint
folder, or a blessed-model location (``BLESSED.json``, see ``persia_core.evaluate.gate``: its latest blessed
model; none blessed yet = cold start). Its config must still match in what the state depends on (tables' dim and
optimizer, the slots and their tables, the dense model and dense features), else the step fails naming each
difference; its rows are re-sharded to this plan (``hashing.shard_of``) and its dense weights are passed on to
training (``warm_start/dense.pt``).

Output folder::

    shard_plan.json         routing rule, shards, per table: dim, optimizer, bytes/row, capacity, estimates;
                            ``warm_start``: where from, rows carried over and dropped
    shards/shard-SSSSS.npz  initial state of each shard
    warm_start/dense.pt     the previous model's dense weights (warm start only)
    run_config.yaml         the run config, passed on to training
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np

from persia_core import io
from persia_core.config import RunConfig
from persia_core.data.reader import read_schema
from persia_core.embedding.shard_file import TableArrays, read_shard_file, write_shard_arrays
from persia_core.embedding.shard_tables import lru_state_dict, make_tables, shard_file_bytes
from persia_core.hashing import shard_of
from persia_core.memory import bytes_per_row, capacity_for_budget
from persia_core.model_store import (
    BLESSED_MARKER,
    MANIFEST,
    MODEL_FORMAT,
    ModelManifest,
    is_blessed_location,
    latest_blessed_model,
    shard_file_name,
)

log = logging.getLogger("persia.plan")

WARM_DENSE = "warm_start/dense.pt"

ROUTING = "shard = splitmix64(feature_id) % num_shards"
SKEW_MARGIN = 1.2
"""Rows of the fullest shard over the mean, allowed for in the estimate (hash routing is close to uniform)."""


class PlanError(ValueError):
    """The embedding tables do not fit the shards' memory budget; the message gives both figures."""


class WarmStartError(ValueError):
    """The model to warm-start from does not match the run config; the message names every difference."""


def make_plan(config: RunConfig, schema: dict) -> dict:
    """The shard plan (see module docstring) as a dict. Raises ``PlanError`` when the estimate exceeds the
    budget of a shard."""
    emb = config.embedding
    n = emb.num_shards
    budget_per_table = emb.shard_memory_bytes // len(emb.tables)
    distinct = schema.get("distinct_ids", {})
    tables = {}
    total_est = 0
    for t in emb.tables:
        ids = sum(int(distinct.get(s.name, 0)) for s in config.slots if s.table == t.name)
        per_shard = int(math.ceil(ids / n * SKEW_MARGIN)) if ids else 0
        cap = capacity_for_budget(budget_per_table, t.optimizer.name, t.dim, emb.storage)
        bpr = bytes_per_row(t.optimizer.name, t.dim, cap, emb.storage)
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
            "slots": [s.name for s in config.slots if s.table == t.name],
        }
        if per_shard > cap:
            raise PlanError(
                f"embedding table {t.name!r}: ~{ids} distinct IDs need ~{per_shard} rows per shard "
                f"(~{est} bytes at {bpr:.1f} bytes/row) on {n} shards, but a shard's budget of "
                f"{emb.shard_memory_bytes} bytes (embedding.shard_memory_bytes) holds {cap}; "
                f"raise the budget or embedding.num_shards"
            )
    return {
        "routing": ROUTING,
        "num_shards": n,
        "shard_memory_bytes": emb.shard_memory_bytes,
        "estimated_bytes_per_shard": total_est,
        "estimated_bytes_total": total_est * n,
        "tables": tables,
    }


# ---- re-sharding --------------------------------------------------------------------------------------------
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
    report = {"rows": {}, "dropped": {}}
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


def resolve_warm_start(path: str) -> str:
    """The Model artifact or checkpoint folder that ``warm_start_from`` names ("" for a cold start): the folder
    itself, or the latest blessed model of a blessed-model location. A location that does not exist yet, or is
    empty, is a blessed-model location before its first model (the first day of a daily schedule): a cold start,
    logged. Raises ``FileNotFoundError`` when it holds files but nothing usable."""
    if not path:
        return ""
    if not io.exists(path) and not io.isdir(path):
        log.warning("warm start from %s: nothing there yet (no model blessed so far); starting cold", path)
        return ""
    if io.exists(io.join(path, MANIFEST)):
        return path
    if is_blessed_location(path):
        return latest_blessed_model(path) or ""
    if io.isdir(path) and not io.listdir(path):
        log.warning("warm start from %s: empty (no model blessed so far); starting cold", path)
        return ""
    raise FileNotFoundError(
        f"warm start from {path!r}: not a Model artifact, checkpoint or blessed-model "
        f"location (no {MANIFEST} or {BLESSED_MARKER})"
    )


def check_warm_start_location(warm_start_from: str, blessed_dir: str) -> None:
    """Before a pipeline run: a ``warm_start_from`` where nothing exists is a cold start only when it is this
    run's own ``blessed_dir`` (the first day of a daily schedule, before anything was blessed). Any other
    missing location is most likely a typo that would cold-start every run of a schedule: raises
    ``FileNotFoundError`` naming both. (``gs://b/p`` and ``/gcs/b/p`` are the same location.)"""
    if not warm_start_from:
        return

    if io.to_uri(warm_start_from.rstrip("/")) == io.to_uri((blessed_dir or "").rstrip("/")):
        return
    if io.exists(warm_start_from) or io.isdir(warm_start_from):
        return
    raise FileNotFoundError(
        f"warm_start_from {warm_start_from!r}: nothing there, and it is not this run's "
        f"blessed_dir {blessed_dir!r} (which may be empty before its first model); a typo "
        f"would start every scheduled run cold"
    )


def warm_start_differences(old: dict, old_dense: list, config: RunConfig, dense: list) -> list[str]:
    """What the previous model's state depends on and this run changed (``key: before -> now``)."""
    out = []
    old_tables = {t["name"]: t for t in old["embedding"]["tables"]}
    for t in config.embedding.tables:
        o = old_tables.get(t.name)
        if o is None:
            out.append(f"embedding.tables[{t.name}]: not in the previous model")
            continue
        if o["dim"] != t.dim:
            out.append(f"embedding.tables[{t.name}].dim: {o['dim']} -> {t.dim}")
        if o["optimizer"]["name"] != t.optimizer.name:
            out.append(f"embedding.tables[{t.name}].optimizer.name: {o['optimizer']['name']!r} -> {t.optimizer.name!r}")
    for name in sorted(set(old_tables) - {t.name for t in config.embedding.tables}):
        out.append(f"embedding.tables[{name}]: not in this run config")

    def slot(s: dict) -> dict:
        return {"source": s.get("source", ""), "cross": list(s.get("cross", [])), "table": s.get("table")}

    old_slots = [s["name"] for s in old["slots"]]
    if old_slots != config.slot_names:
        out.append(f"slots: {old_slots} -> {config.slot_names}")
    for s in config.to_dict()["slots"]:
        o = next((x for x in old["slots"] if x["name"] == s["name"]), None)
        if o is not None and slot(o) != slot(s):
            out.append(f"slots[{s['name']}]: {slot(o)} -> {slot(s)}")
    new_model = config.to_dict()["model"]
    for k in sorted(set(old["model"]) | set(new_model)):
        if old["model"].get(k) != new_model.get(k):
            out.append(f"model.{k}: {old['model'].get(k)!r} -> {new_model.get(k)!r}")
    if list(old_dense) != list(dense):
        out.append(f"dense features: {list(old_dense)} -> {list(dense)}")
    return out


def warm_start(config: RunConfig, schema: dict, source: str, output_dir: str, capacities: dict[str, int]) -> dict:
    """Write every shard's initial state from the rows and optimizer state of ``source`` (a Model artifact or a
    checkpoint), re-sharded to ``config.embedding.num_shards``, and its dense weights to ``WARM_DENSE``.
    Returns what was carried over. Raises ``WarmStartError`` naming the differences when the config no longer
    matches, ``ShardFileError`` for a corrupt shard file."""
    import io as _io

    import torch

    manifest = json.loads(io.read_text(io.join(source, MANIFEST)))
    fmt = manifest.get("format", "")
    if fmt == MODEL_FORMAT:
        model = ModelManifest.from_dict(manifest, io.join(source, MANIFEST))
        old_config, old_dense = model.config, model.dense
        crcs: list[int | None] = list(model.shard_crc32c) if model.shard_crc32c else [None] * model.num_shards
        shards = [{"path": rel, "bytes": None, "crc32c": c} for rel, c in zip(model.shard_files, crcs, strict=True)]
        dense_rel = model.dense_file
    elif fmt.startswith("persia-checkpoint/"):
        from persia_core.train.checkpoint import CheckpointError, verify

        try:  # the checks a resume makes: the manifest's own CRC, every shard listed, sizes and CRCs
            manifest = verify(source, deep=True, deep_roles=("dense",))
        except CheckpointError as e:
            raise WarmStartError(f"warm start from {source} refused: {e}") from e
        old_config = manifest["lineage"]["config"]
        old_dense = schema["dense"]  # a checkpoint of a run on the same preprocess layout
        shards = sorted((e for e in manifest["files"] if e.get("role") == "shard"), key=lambda e: e["shard"])
        dense_rel = "dense.pt"
    else:
        raise WarmStartError(f"warm start from {source}: unknown format {fmt!r}")
    problems = warm_start_differences(old_config, old_dense, config, schema["dense"])
    if problems:
        raise WarmStartError(
            f"warm start from {source} refused: the run config no longer matches the previous "
            f"model: " + "; ".join(problems)
        )
    sources = [
        read_shard_file(io.join(source, e["path"]), e.get("bytes"), e.get("crc32c"), build_index=False).tables
        for e in shards
    ]
    new, report = reshard(sources, config.embedding.num_shards, capacities)
    files = []
    for s, tables in enumerate(new):
        rel = shard_file_name(s)
        write_shard_arrays(io.join(output_dir, rel), tables)
        files.append(rel)
    dense_path = io.join(source, dense_rel)
    try:
        state = io.read_state_dict(dense_path)
        if fmt != MODEL_FORMAT:
            state = state["model"]
    except (ValueError, KeyError) as e:
        raise WarmStartError(f"warm start from {source}: its dense weights {dense_path} cannot be read: {e}") from e
    buf = _io.BytesIO()
    torch.save(state, buf)
    io.write_bytes(io.join(output_dir, WARM_DENSE), buf.getvalue())
    return {
        "from": source,
        "format": fmt,
        "previous_num_shards": len(shards),
        "rows": report["rows"],
        "dropped_rows": report["dropped"],
        "dense_file": WARM_DENSE,
        "shard_files": files,
    }


def init_shards(config: RunConfig, data_dir: str, output_dir: str, warm_start_from: str = "") -> dict:
    """Write the shard plan, run config and initial shard states to ``output_dir``. Returns the plan.

    ``warm_start_from``: see the module docstring ("" = cold start). Raises ``FileNotFoundError`` when
    ``data_dir`` has no ``schema.json`` or ``warm_start_from`` names nothing usable, ``PlanError`` when the plan
    does not fit the memory budget, ``WarmStartError`` when the previous model does not match the config."""
    schema = read_schema(data_dir)
    plan = make_plan(config, schema)
    caps = {name: t["capacity_rows_per_shard"] for name, t in plan["tables"].items()}
    source = resolve_warm_start(warm_start_from)
    if source:
        plan["warm_start"] = warm_start(config, schema, source, output_dir, caps)
        files = plan["warm_start"].pop("shard_files")
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
