"""Warm start (recurring retraining): the initial shard state and dense weights from a previous run's model.

``warm_start_from`` names the previous run's Model artifact, a checkpoint folder, or a blessed-model location
(``BLESSED.json``, see ``persia_core.evaluate.gate``: its latest blessed model; none blessed yet = cold start).
Its config must still match in what the state depends on (tables' dim and optimizer, the slots and their tables,
the dense model and dense features), else the step fails naming each difference; its rows are re-sharded to
this plan (``persia_core.embedding.reshard``), converted to this run's ``embedding.storage`` precision where it
changed (fp32 <-> fp16 / bf16: rows exact to the target's rounding), and its dense weights are passed on to
training (``warm_start/dense.pt``).
"""

from __future__ import annotations

import io as _io
import json
import logging
from typing import Any

import numpy as np

from persia_core import io
from persia_core.checkpoints import CheckpointError, verify
from persia_core.config import RunConfig
from persia_core.embedding.precision import decode, encode
from persia_core.embedding.reshard import reshard
from persia_core.embedding.shard_file import read_shard_file, write_shard_arrays
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


class WarmStartError(ValueError):
    """The model to warm-start from does not match the run config; the message names every difference."""


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
    """What the previous model's state depends on and this run changed (``key: before -> now``). A table added
    since (the wide table of ``model.wide``, or one no slot used before) is not a difference: it starts cold;
    turning ``model.wide`` on is none either (its linear term of the dense features starts at 0 too:
    ``load_dense_weights``), nor are ``model.dropout`` and ``model.bias_init`` (no weight, and a model saved
    before the keys existed had none)."""
    out = []
    old_tables = {t["name"]: t for t in old["embedding"]["tables"]}
    for t in config.embedding.tables:
        o = old_tables.get(t.name)
        if o is None:
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
    for k in sorted((set(old["model"]) | set(new_model)) - {"wide", "dropout", "bias_init"}):
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
    # lazy: torch is needed for the dense weights only; the pipeline compilers import this module for
    # check_warm_start_location
    import torch

    manifest = json.loads(io.read_text(io.join(source, MANIFEST)))
    fmt = manifest.get("format", "")
    if fmt == MODEL_FORMAT:
        model = ModelManifest.from_dict(manifest, io.join(source, MANIFEST))
        old_config, old_dense = model.config, model.dense
        crcs: list[int | None] = list(model.shard_crc32c) if model.shard_crc32c else [None] * model.num_shards
        shards: list[dict[str, Any]] = [
            {"path": rel, "bytes": None, "crc32c": c} for rel, c in zip(model.shard_files, crcs, strict=True)
        ]
        dense_rel = model.dense_file
    elif fmt.startswith("persia-checkpoint/"):
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
    cold = sorted({t.name for t in config.embedding.tables} - {t["name"] for t in old_config["embedding"]["tables"]})
    if problems:
        raise WarmStartError(
            f"warm start from {source} refused: the run config no longer matches the previous "
            f"model: " + "; ".join(problems)
        )
    if cold:
        log.info("warm start: table(s) %s not in the previous model start cold; the others warm", ", ".join(cold))
    sources = [
        read_shard_file(io.join(source, e["path"]), e.get("bytes"), e.get("crc32c"), build_index=False).tables
        for e in shards
    ]
    old_storage = old_config.get("embedding", {}).get("storage", "fp32")
    if old_storage != config.embedding.storage:  # rows exact to the new precision's rounding (or widened exactly)
        for tables in sources:
            for ta in tables.values():
                rows = decode(np.asarray(ta.arrays["weights"]), old_storage)
                ta.arrays["weights"] = encode(rows, config.embedding.storage)
        log.info("warm start: embedding rows converted from %s to %s storage", old_storage, config.embedding.storage)
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
        "cold_tables": cold,
    }
