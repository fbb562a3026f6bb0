"""The model store: the Model artifact's format with its one reader and one writer, and the blessed-model layout.

A Model artifact (a local, ``/gcs/...`` or ``gs://`` folder)::

    manifest.json          written last, by ``write_manifest`` only (``ModelManifest``): format, run config,
                           shard files and their CRC-32C, dense file, slots, dense-feature statistics, summary,
                           lineage (code version, config hash, input fingerprints)
    dense.pt               the dense model's state dict (torch, weights only)
    shards/shard-SSSSS.npz one shard file per parameter-server shard (``persia_core.embedding.shard_file``)
    train_metrics.json     loss, throughput and staleness curves, per-shard rows

A blessed-model location (the gate's output, ``persia_core.evaluate.gate``)::

    BLESSED.json           the marker: {"format", "model": "models/<version>", "metrics", ...}, written last
    models/<version>/      a full copy of each blessed Model artifact

A leaf module: ``persia_core.io`` and the standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from persia_core import io

MODEL_FORMAT = "persia-model/1"
"""``format`` of every Model manifest this code writes and reads."""
MANIFEST = "manifest.json"
DENSE_FILE = "dense.pt"
METRICS_FILE = "train_metrics.json"
BLESSED_MARKER = "BLESSED.json"
BLESSED_MODELS_DIR = "models"
BLESSED_FORMAT = "persia-blessed/1"


def shard_file_name(shard: int) -> str:
    """The shard file of shard ``shard``, relative to a Model, checkpoint or init-shards folder."""
    return f"shards/shard-{shard:05d}.npz"


class IncompleteModelError(FileNotFoundError):
    """A file a Model manifest lists does not exist; the message names it."""


@dataclass
class ModelManifest:
    """A Model artifact's ``manifest.json``. Manifests written before ``shard_crc32c`` or ``lineage`` existed
    load with those empty (their shard files are then checked by the zip CRCs alone)."""

    config: dict[str, Any]
    """The run config (``RunConfig.to_dict()``)."""
    shard_files: list[str]
    """Shard file of each shard, relative to the model folder (``shard_file_name``)."""
    slots: list[str]
    dense: list[str]
    """Dense feature names, in the model's input order."""
    shard_crc32c: list[int] | None = None
    """CRC-32C of each whole shard file, as its server wrote it (checked by a warm start); None: unknown."""
    dense_mean: list[float] | None = None
    dense_std: list[float] | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    """samples_per_s, max_staleness, final_loss, wall_seconds, rows (per shard)."""
    lineage: dict[str, Any] | None = None
    """code_version, config_sha256, config, data fingerprints (``persia_core.checkpoints.lineage``)."""
    dense_file: str = DENSE_FILE
    resumed_from: str | None = None
    checkpoints_refused: list[str] = field(default_factory=list)
    last_checkpoint: str | None = None
    warm_start: dict[str, Any] | None = None
    deltas: dict[str, Any] | None = None
    """Where the run's parameter servers wrote incremental exports: ``{"dir": ..., "every_s": ...}``; None: none."""
    format: str = MODEL_FORMAT

    @property
    def num_shards(self) -> int:
        return len(self.shard_files)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's JSON object (``num_shards`` included)."""
        d = dataclasses.asdict(self)
        return {"format": d.pop("format"), "config": d.pop("config"), "num_shards": self.num_shards, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "manifest") -> ModelManifest:
        """Raises ``ValueError`` naming ``where`` for another format or a missing key."""
        if not isinstance(d, dict) or d.get("format") != MODEL_FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"{where}: unknown model format {got!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in d
        ]
        if missing:
            raise ValueError(f"{where}: a model manifest needs {missing}")
        kw = {k: v for k, v in d.items() if k in names}
        if "num_shards" in d and int(d["num_shards"]) != len(kw["shard_files"]):
            raise ValueError(f"{where}: num_shards {d['num_shards']} but {len(kw['shard_files'])} shard files")
        return cls(**kw)


def write_manifest(model_dir: str, manifest: ModelManifest) -> dict[str, Any]:
    """Write ``model_dir/manifest.json``, last, after checking that the dense file and every shard file it lists
    exist. Returns the manifest's JSON object. Raises ``IncompleteModelError`` naming a missing file."""
    for rel in (manifest.dense_file, *manifest.shard_files):
        if not io.exists(io.join(model_dir, rel)):
            raise IncompleteModelError(f"training finished but {io.join(model_dir, rel)} is missing")
    if manifest.shard_crc32c is not None and len(manifest.shard_crc32c) != manifest.num_shards:
        raise ValueError(f"{model_dir}: {len(manifest.shard_crc32c)} CRCs for {manifest.num_shards} shard files")
    d = manifest.to_dict()
    io.write_text(io.join(model_dir, MANIFEST), json.dumps(d, indent=1))
    return d


def read_manifest(model_dir: str) -> tuple[str, ModelManifest]:
    """``(model folder, its manifest)`` of a Model artifact, without loading it; a blessed-model location resolves
    to its latest blessed model. Raises ``FileNotFoundError`` when ``model_dir`` is neither, ``ValueError`` for
    an unknown model format or a malformed manifest."""
    path = io.join(model_dir, MANIFEST)
    if not io.exists(path) and io.exists(io.join(model_dir, BLESSED_MARKER)):
        model_dir = latest_blessed_model(model_dir) or model_dir
        path = io.join(model_dir, MANIFEST)
    if not io.exists(path):
        raise FileNotFoundError(f"{path}: not a trained model (no {MANIFEST}) nor a blessed-model location")
    try:
        raw = json.loads(io.read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    return model_dir, ModelManifest.from_dict(raw, path)


def manifest_digest(model_dir: str) -> str:
    """The first 16 hex digits of the SHA-256 of the manifest of ``model_dir`` (a Model artifact or a
    blessed-model location): the model's identity whatever folder holds it (a blessed copy and a Registry upload
    keep the manifest's bytes), as the manifest records the shard files' CRC-32C and the config. Raises as
    ``read_manifest``."""
    folder, _ = read_manifest(model_dir)
    return folder_digest(folder)


def folder_digest(folder: str) -> str:
    """``manifest_digest`` of the folder itself (a Model artifact or a checkpoint), its manifest unparsed."""
    return hashlib.sha256(io.read_text(io.join(folder, MANIFEST)).encode()).hexdigest()[:16]


def read_marker(blessed_dir: str) -> dict[str, Any] | None:
    """The ``BLESSED.json`` marker of ``blessed_dir`` as a dict, or ``None`` when there is none (nothing has
    been blessed there yet). Raises ``ValueError`` for a marker that is not valid JSON or of another format."""
    if not blessed_dir:
        return None
    path = io.join(blessed_dir, BLESSED_MARKER)
    if not io.exists(path):
        return None
    try:
        marker = json.loads(io.read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(marker, dict) or marker.get("format") != BLESSED_FORMAT:
        raise ValueError(f"{path}: not a blessed-model marker of format {BLESSED_FORMAT!r}")
    if not isinstance(marker.get("model"), str) or not marker["model"] or not isinstance(marker.get("metrics"), dict):
        raise ValueError(f"{path}: a blessed-model marker needs 'model' (the blessed model's folder) and 'metrics'")
    return marker


def latest_blessed_model(blessed_dir: str) -> str | None:
    """Path of the latest blessed Model artifact (a folder with ``manifest.json``), or ``None``: the model a
    next run warm-starts from."""
    marker = read_marker(blessed_dir)
    return io.join(blessed_dir, marker["model"]) if marker is not None else None


def is_blessed_location(path: str) -> bool:
    """Whether ``path`` holds a blessed-model marker."""
    return bool(path) and io.exists(io.join(path, BLESSED_MARKER))
