"""The end of a training run: per-shard figures into ``train_metrics.json``, then the Model manifest, last.

Both ways of training finish here: the local launcher (``persia_core.train.launcher.train``) and the primary
replica of a Vertex AI job (``persia_core.cluster``), so a Model carries the same manifest, shard CRCs and
lineage whichever way it was trained (``persia_core.model_store`` is the format).
"""

from __future__ import annotations

import json
from typing import Any

from persia_core import io
from persia_core.config import RunConfig
from persia_core.model_store import METRICS_FILE, ModelManifest, shard_file_name, write_manifest


def finish_model(
    model_dir: str,
    config: RunConfig,
    schema: dict[str, Any],
    dumped: list[tuple[int, int]],
    stats: list[dict[str, Any]],
    wall_seconds: float,
    lineage: dict[str, Any],
    **provenance: Any,
) -> dict[str, Any]:
    """Write the Model manifest of a finished run whose servers have dumped their shards into ``model_dir``.

    ``dumped``: ``(bytes, CRC-32C)`` of each shard file as its server wrote it; ``stats``: each server's ``Stats``
    answer; ``lineage``: ``persia_core.checkpoints.lineage(config, data_dir)``; ``provenance``: the
    ``ModelManifest`` fields of a resumed or warm-started run (``resumed_from``, ``checkpoints_refused``,
    ``last_checkpoint``, ``warm_start``) and ``deltas``. Returns the manifest's JSON object. Raises
    ``IncompleteModelError`` naming a file the manifest would list but that is missing."""
    history = json.loads(io.read_text(io.join(model_dir, METRICS_FILE)))
    history["shards"] = [
        {
            "shard": s["shard"],
            "rows": sum(t["rows"] for t in s["tables"].values()),
            "bytes": dumped[i][0],
            "evictions": sum(t["evictions"] for t in s["tables"].values()),
            "dropped_gradients": sum(t["dropped_gradients"] for t in s["tables"].values()),
        }
        for i, s in enumerate(stats)
    ]
    io.write_text(io.join(model_dir, METRICS_FILE), json.dumps(history))
    manifest = ModelManifest(
        config=config.to_dict(),
        shard_files=[shard_file_name(s) for s in range(len(dumped))],
        shard_crc32c=[crc for _, crc in dumped],
        slots=[s.name for s in config.slots],
        dense=schema["dense"],
        dense_mean=schema.get("dense_mean"),
        dense_std=schema.get("dense_std"),
        summary={
            "samples_per_s": history["samples_per_s"],
            "max_staleness": history["max_staleness"],
            "final_loss": history["loss"][-1] if history["loss"] else None,
            "wall_seconds": wall_seconds,
            "rows": [s["rows"] for s in history["shards"]],
        },
        lineage=lineage,
        **provenance,
    )
    return write_manifest(model_dir, manifest)
