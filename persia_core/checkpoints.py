"""The checkpoint format of a training run: layout, manifest (write, read, verify), finding the newest complete
checkpoint, and the lineage that ties a checkpoint (and a Model) to its config, code and input data.

A checkpoint holds every shard's tables, the dense model and optimizer, every NN worker's data position and RNG
states, with a manifest that makes it whole or ignored.

Layout (local, ``/gcs/`` or ``gs://``)::

    <ckpt_dir>/ckpt-SSSSSSSSSS/        S = steps done (the next step to train)
        shards/shard-NNNNN.npz         one per parameter-server shard (``persia_core.embedding.shard_file``): rows,
                                       optimizer state, recency list, hash index, applied-push records
        dense.pt                       {"model": state_dict, "optimizer": Adam state_dict} (torch.save, no pickles
                                       needed to load: ``torch.load(..., weights_only=True)``)
        workers/rank-RRRRR.json        data position (next step, samples seen), RNG states, loss history (rank 0)
        manifest.json                  written last: every file with its size and CRC-32C, the step, lineage

The manifest is written last, by an atomic rename (``os.replace``; on Cloud Storage the manifest object is
uploaded last, and an object appears whole), so a checkpoint is whole or ignored: a folder without a manifest, or
whose files differ from it in size or CRC-32C, is refused with a message naming the file and check, and the
previous checkpoint is used (``find_latest``). The NN workers write checkpoints from their loop
(``persia_core.train.checkpointer``).

Lineage in every manifest: the code version (``git describe`` or the package version), the SHA-256 of the run
config's YAML, the config itself (so a mismatch can be named), and fingerprints of the input data (``schema.json``
row counts and SHA-256, every train shard's size and CRC-32C).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version

from persia_core import io
from persia_core.config import RunConfig
from persia_core.data.schema import SCHEMA_FILE
from persia_core.embedding.checksums import crc32c, file_crc32c
from persia_core.model_store import shard_file_name

FORMAT = "persia-checkpoint/2"
"""The checkpoint manifest's format: 2 always carries ``manifest_crc32c``; 1, written before, may not."""
READABLE_FORMATS = ("persia-checkpoint/1", FORMAT)
MANIFEST = "manifest.json"
DENSE_FILE = "dense.pt"
NAME = re.compile(r"^ckpt-(\d{10})$")
log = logging.getLogger("persia.checkpoint")

RESUME_MAY_DIFFER = (
    "layout",
    "split",
    "embedding.num_shards",
    "embedding.shard_memory_bytes",
    "trainer.epochs",
    "trainer.embedding_staleness",
    "trainer.fresh_lookups",
    "trainer.rpc_timeout_s",
    "trainer.threads_per_worker",
    "trainer.prefetch_threads",
    "trainer.embedding_workers",
    "trainer.device",
    "trainer.network_delay_s",
    "trainer.network_bandwidth_bytes_per_s",
    "trainer.shared_memory",
    "trainer.delta_every_s",
    "trainer.checkpoint_every_steps",
    "trainer.checkpoint_every_s",
    "trainer.checkpoint_keep",
    "trainer.checkpoint_at_end",
    "trainer.checkpoint_dir",
)
"""Config keys (prefixes) that may change between a checkpoint and the run resuming from it: the data is
fingerprinted separately, shards are re-routed, more epochs continue the same schedule, and the rest are
execution settings that leave the arithmetic (at K = 0) unchanged."""


class CheckpointError(ValueError):
    """A checkpoint is partial, corrupt, or does not belong to this run; the message names the file and check."""


@dataclass
class CheckpointSettings:
    """When and where a training run writes checkpoints (proposed ``trainer.checkpoint_*`` config fields).

    ``dir`` empty: ``<model_dir>/checkpoints``. A checkpoint is written every ``every_steps`` steps and/or every
    ``every_s`` seconds (0 = off), and at the end when ``at_end``; the newest ``keep`` complete ones are kept."""

    dir: str = ""
    every_steps: int = 0
    every_s: float = 0.0
    keep: int = 2
    at_end: bool = True

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError("checkpoint every_steps must be >= 0")
        if self.every_s < 0:
            raise ValueError("checkpoint every_s must be >= 0")
        if self.keep < 1:
            raise ValueError("checkpoint keep must be >= 1")

    @property
    def periodic(self) -> bool:
        return self.every_steps > 0 or self.every_s > 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CheckpointSettings:
        return cls(**json.loads(text)) if text else cls()


def checkpoint_settings(
    config: RunConfig, model_dir: str, settings: CheckpointSettings | None = None
) -> CheckpointSettings:
    """The checkpoint settings of a run: ``settings`` if given, else the ``trainer.checkpoint_*`` config
    fields; an empty folder means ``<model_dir>/checkpoints``."""
    if settings is None:
        tc = config.trainer
        settings = CheckpointSettings(
            dir=tc.checkpoint_dir,
            every_steps=tc.checkpoint_every_steps,
            every_s=tc.checkpoint_every_s,
            keep=tc.checkpoint_keep,
            at_end=tc.checkpoint_at_end,
        )
    if not settings.dir:
        settings = type(settings)(**{**settings.__dict__, "dir": io.join(model_dir, "checkpoints")})
    return settings


# ---- names, manifests, verification -------------------------------------------------------------------------
def checkpoint_path(ckpt_dir: str, step: int) -> str:
    return io.join(ckpt_dir, f"ckpt-{int(step):010d}")


def rank_file(rank: int) -> str:
    return f"workers/rank-{rank:05d}.json"


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint folder under ``ckpt_dir`` (complete or not), newest first."""
    if not ckpt_dir or not io.exists(ckpt_dir):
        return []
    out = []
    for name in io.listdir(ckpt_dir):
        m = NAME.match(name)
        if m:
            out.append((int(m.group(1)), io.join(ckpt_dir, name)))
    return sorted(out, reverse=True)


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at ``path``. Raises ``CheckpointError`` when it is missing (a partial
    checkpoint) or unreadable."""
    mpath = io.join(path, MANIFEST)
    if not io.exists(mpath):
        raise CheckpointError(
            f"{path}: no {MANIFEST} (a partial checkpoint: it was being written when the run stopped)"
        )
    try:
        manifest = json.loads(io.read_text(mpath))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest: {e}") from e
    if (
        not isinstance(manifest, dict)
        or not isinstance(manifest.get("files", []), list)
        or not all(
            isinstance(e, dict)
            and isinstance(e.get("path"), str)
            and isinstance(e.get("bytes"), int)
            and isinstance(e.get("crc32c"), int)
            for e in manifest.get("files", [])
        )
    ):
        raise CheckpointError(f"{mpath}: malformed manifest (each file needs path, bytes and crc32c)")
    if manifest.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{mpath}: unknown checkpoint format {manifest.get('format')!r}")
    if "manifest_crc32c" not in manifest:
        if manifest["format"] == FORMAT:
            raise CheckpointError(
                f"{mpath}: carries no CRC-32C of its own (manifest_crc32c), which every manifest of "
                f"{FORMAT} has (edited manifest)"
            )
        log.warning(
            "%s: a manifest of %s, with no CRC-32C of its own; only its files' are checked", mpath, manifest["format"]
        )
    elif manifest_crc(manifest) != manifest["manifest_crc32c"]:
        raise CheckpointError(f"{mpath}: its CRC-32C does not match its content (edited or corrupt manifest)")
    _check_complete(path, manifest)
    return manifest


def manifest_crc(manifest: dict) -> int:
    """CRC-32C of the manifest's canonical JSON without its own ``manifest_crc32c`` field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32c"}
    return crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def _check_complete(path: str, manifest: dict) -> None:
    """The manifest must list the dense file, one file per NN worker and one per shard (by its own
    ``num_workers`` and ``num_shards``). Raises ``CheckpointError`` naming what is missing."""
    if "num_shards" not in manifest or "num_workers" not in manifest:
        return
    listed = {e["path"] for e in manifest.get("files", [])}
    try:
        wanted = [
            DENSE_FILE,
            *(rank_file(r) for r in range(int(manifest["num_workers"]))),
            *(shard_file_name(s) for s in range(int(manifest["num_shards"]))),
        ]
    except (TypeError, ValueError) as e:  # counts that are no integers (read_manifest checked the file list)
        raise CheckpointError(f"{io.join(path, MANIFEST)}: malformed manifest ({e})") from e
    missing = [w for w in wanted if w not in listed]
    if missing:
        raise CheckpointError(
            f"{io.join(path, MANIFEST)}: lists no {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} (num_shards {manifest['num_shards']}, "
            f"num_workers {manifest['num_workers']}): an incomplete checkpoint"
        )


def _size(path: str) -> int | None:
    if io.is_remote(path):
        from google.api_core.exceptions import NotFound

        bucket, key = io.split_gcs(path)
        blob = io.gcs_client().bucket(bucket).blob(key)
        try:
            blob.reload()
        except NotFound:
            return None
        return int(blob.size)
    return os.path.getsize(path) if os.path.isfile(path) else None


def verify(path: str, deep: bool = True, deep_roles: tuple[str, ...] | None = None) -> dict:
    """Check a checkpoint against its manifest; returns the manifest.

    Every file listed must exist with the listed size; with ``deep``, also with the listed CRC-32C (only for
    files whose role is in ``deep_roles`` when given: e.g. the launcher leaves the shard files to the servers,
    which check them as they load). Raises ``CheckpointError`` naming the file and the failed check."""
    manifest = read_manifest(path)
    for entry in manifest.get("files", []):
        fpath = io.join(path, entry["path"])
        size = _size(fpath)
        if size is None:
            raise CheckpointError(f"{fpath}: listed in the manifest but missing")
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{fpath}: {size} bytes, the manifest says {entry['bytes']} (partial or overwritten file)"
            )
        if deep and (deep_roles is None or entry.get("role") in deep_roles):
            _, crc = file_crc32c(fpath)
            if crc != entry["crc32c"]:
                raise CheckpointError(
                    f"{fpath}: CRC-32C {crc:08x} does not match the manifest's {entry['crc32c']:08x} (corrupt file)"
                )
    return manifest


def find_latest(
    ckpt_dir: str,
    skip: set[str] | frozenset = frozenset(),
    deep_roles=("dense", "worker"),
    refusals: list[str] | None = None,
) -> tuple[str, dict] | None:
    """The newest checkpoint under ``ckpt_dir`` that passes ``verify`` (shard files: size only; their CRC-32C
    is checked by the servers as they load them), skipping paths in ``skip`` (refused by a server). A refused
    checkpoint is logged (and its reason appended to ``refusals``) and the previous one is tried.

    None when there is none, or only partial ones (no manifest: a run stopped while writing its first): a fresh
    start then loses nothing. Raises ``CheckpointError`` when complete checkpoints exist but every one is refused:
    starting afresh would silently throw their training away (to do so on purpose: resume_from '')."""
    complete_refused: list[str] = []
    refusals = refusals if refusals is not None else []
    for _step, path in list_checkpoints(ckpt_dir):
        if path in skip:
            complete_refused.append(path)
            continue
        try:
            return path, verify(path, deep=True, deep_roles=deep_roles)
        except CheckpointError as e:
            log.warning("checkpoint refused, trying the previous one: %s", e)
            if str(e) not in refusals:  # a retry after a server's refusal verifies the older ones again
                refusals.append(str(e))
            if io.exists(io.join(path, MANIFEST)):
                complete_refused.append(path)
    if complete_refused:
        why = "; ".join(refusals[-3:]) if refusals else "refused by a parameter server"
        raise CheckpointError(
            f"every checkpoint under {ckpt_dir} is refused ({len(complete_refused)} complete "
            f"ones: {why}); not starting afresh silently (to start afresh on purpose: a new "
            f"output folder, or remove the checkpoints)"
        )
    return None


def read_file_checked(ckpt: str, manifest: dict, rel: str) -> bytes:
    """A checkpoint file's bytes, checked against the manifest's size and CRC-32C."""
    entries = {e["path"]: e for e in manifest.get("files", [])}
    if rel not in entries:
        raise CheckpointError(f"{io.join(ckpt, rel)}: not listed in the manifest")
    data = io.read_bytes(io.join(ckpt, rel))
    e = entries[rel]
    if len(data) != e["bytes"] or crc32c(data) != e["crc32c"]:
        raise CheckpointError(f"{io.join(ckpt, rel)}: size or CRC-32C differ from the manifest (corrupt file)")
    return data


# ---- writing ------------------------------------------------------------------------------------------------
def write_durable(path: str, data: bytes) -> tuple[int, int]:
    """Write a whole file, durable before it is visible (local: temporary name, fsync, rename, fsync of the
    folder; Cloud Storage: one upload). Returns ``(bytes, CRC-32C)``."""
    if io.is_remote(path):
        io.write_bytes(path, data)
        return len(data), crc32c(data)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with io.atomic_local_file(path, fsync=True) as f:
        f.write(data)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(data), crc32c(data)


def remove_manifest(path: str) -> None:
    """Make a checkpoint folder incomplete (before its files are overwritten)."""
    mpath = io.join(path, MANIFEST)
    if io.exists(mpath):
        if io.is_remote(mpath):
            io.remove(mpath)
        else:
            os.remove(mpath)


def write_manifest(path: str, step: int, files: list[dict], lineage: dict, extra: dict | None = None) -> dict:
    """Write the manifest last, atomically: from then on the checkpoint at ``path`` is complete."""
    manifest = {
        "format": FORMAT,
        "step": int(step),
        "created_unix": time.time(),
        "files": files,
        "lineage": lineage,
        **(extra or {}),
    }
    manifest["manifest_crc32c"] = manifest_crc(manifest)
    write_durable(io.join(path, MANIFEST), json.dumps(manifest, indent=1).encode("utf-8"))
    return manifest


def _rmtree(path: str) -> None:
    if io.is_remote(path):
        for rel in io.walk_files(path):
            io.remove(io.join(path, rel))
    else:
        shutil.rmtree(path, ignore_errors=True)


def prune(ckpt_dir: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete ones older than the newest
    complete one (leftovers of interrupted writes). Returns the deleted paths."""
    complete: list[int] = []
    removed: list[str] = []
    for step, path in list_checkpoints(ckpt_dir):
        has = io.exists(io.join(path, MANIFEST))
        if has and len(complete) < keep:
            complete.append(step)
            continue
        if has or (complete and step < complete[0]):
            remove_manifest(path)
            _rmtree(path)
            removed.append(path)
    return removed


# ---- lineage ------------------------------------------------------------------------------------------------
def code_version() -> str:
    """``git describe --always --dirty --tags`` of the source tree, else the installed package version."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.exists(os.path.join(root, ".git")):
        try:
            out = subprocess.run(
                ["git", "-C", root, "describe", "--always", "--dirty", "--tags"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            if out.returncode == 0 and out.stdout.strip():
                return "git:" + out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        return "persia-kfp " + version("persia-kfp")
    except Exception:  # not installed
        return "unknown"


def config_sha256(config: RunConfig) -> str:
    return hashlib.sha256(config.to_yaml().encode("utf-8")).hexdigest()


def _remote_fingerprint(path: str) -> dict | None:
    try:
        uri = io.to_uri(path)
        if not io.is_gcs(uri):
            return None
        bucket, key = io.split_gcs(uri)
        blob = io.gcs_client().bucket(bucket).blob(key)
        blob.reload()
        return {"bytes": int(blob.size), "crc32c": int.from_bytes(base64.b64decode(blob.crc32c), "big")}
    except Exception:  # no credentials or no metadata: fall back to reading the file
        return None


def data_fingerprint(data_dir: str) -> dict:
    """Fingerprints of the preprocessed input: ``schema.json`` (its SHA-256 and row counts) and every train shard's
    size and CRC-32C (on Cloud Storage from the object's metadata, without reading it)."""
    raw = io.read_bytes(io.join(data_dir, SCHEMA_FILE))
    schema = json.loads(raw)
    files = {}
    for rel in schema.get("train_files", []):
        path = io.join(data_dir, rel)
        fp = _remote_fingerprint(path) if (io.is_gcs(path) or path.startswith("/gcs/")) else None
        if fp is None:
            size, crc = file_crc32c(path)
            fp = {"bytes": size, "crc32c": crc}
        files[rel] = fp
    return {"schema_sha256": hashlib.sha256(raw).hexdigest(), "rows": schema.get("rows", {}), "train_files": files}


def lineage(config: RunConfig, data_dir: str) -> dict:
    """Code version, run config hash and input data fingerprints (see module docstring)."""
    return {
        "code_version": code_version(),
        "config_sha256": config_sha256(config),
        "config": config.to_dict(),
        "data": data_fingerprint(data_dir),
    }


def _flatten(d, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(d, list) and d and all(isinstance(x, dict) and "name" in x for x in d):
        out[f"{prefix}[names]"] = [x["name"] for x in d]
        for x in d:
            out.update(_flatten(x, f"{prefix}[{x['name']}]"))
    else:
        out[prefix] = d
    return out


def config_differences(old: dict, new: dict, may_differ=(), only=None) -> list[str]:
    """Human-readable differences between two configs (``RunConfig.to_dict()``), as ``key: old -> new``.

    Keys starting with one of ``may_differ`` are ignored; with ``only``, just keys starting with one of those
    are compared. Lists of named items (tables, slots) are compared item by item, by name."""
    a, b = _flatten(old), _flatten(new)

    def keep(k: str) -> bool:
        def under(prefixes):
            return any(k == p or k.startswith(p + ".") or k.startswith(p + "[") for p in prefixes)

        return (only is None or under(only)) and not under(may_differ)

    out = []
    for k in sorted(set(a) | set(b)):
        if keep(k) and a.get(k, "<absent>") != b.get(k, "<absent>"):
            out.append(f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}")
    return out


def check_lineage(manifest: dict, current: dict, where: str) -> None:
    """Refuse to resume from a checkpoint of another run: the config (but ``RESUME_MAY_DIFFER``) and the input
    data must be the same. Raises ``CheckpointError`` naming the differences."""
    old = manifest.get("lineage", {})
    problems = config_differences(old.get("config", {}), current["config"], RESUME_MAY_DIFFER)
    od, nd = old.get("data", {}), current["data"]
    if od.get("train_files") != nd.get("train_files") or od.get("rows") != nd.get("rows"):
        changed = sorted(
            k
            for k in set(od.get("train_files", {})) | set(nd.get("train_files", {}))
            if od.get("train_files", {}).get(k) != nd.get("train_files", {}).get(k)
        )
        problems.append(f"input data differs (train files changed: {changed or 'row counts'})")
    if problems:
        raise CheckpointError(
            f"{where} was written by another run; refusing to resume from it: "
            + "; ".join(problems[:10])
            + ("" if len(problems) <= 10 else " ...")
            + " (to start afresh: a new output folder, or remove the checkpoints)"
        )
