"""Paths that may be local, ``gs://bucket/key`` URIs, or the ``/gcs/bucket/key`` mount KFP uses on Vertex AI.

Local and ``/gcs/`` paths use the file system; ``gs://`` goes through ``google-cloud-storage`` (which honours
``STORAGE_EMULATOR_HOST``). ``join`` never turns ``gs://b/x`` into ``gs:/b/x``.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path


def is_gcs(path: str) -> bool:
    return str(path).startswith("gs://")


def join(base: str, *parts: str) -> str:
    """Join path parts; keeps the ``gs://`` scheme intact."""
    base = str(base)
    if is_gcs(base):
        out = base.rstrip("/")
        for p in parts:
            out = out + "/" + str(p).strip("/")
        return out
    return os.path.join(base, *map(str, parts))


def _split_gcs(uri: str) -> tuple[str, str]:
    rest = uri[len("gs://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"not a gs:// URI with a bucket: {uri!r}")
    return bucket, key


def _client():
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT", "test"), credentials=AnonymousCredentials())
    return storage.Client()


def _blob(uri: str):
    bucket, key = _split_gcs(uri)
    return _client().bucket(bucket).blob(key)


def exists(path: str) -> bool:
    if is_gcs(path):
        bucket, key = _split_gcs(path)
        client = _client()
        if client.bucket(bucket).blob(key).exists():
            return True
        return any(True for _ in client.list_blobs(bucket, prefix=key.rstrip("/") + "/", max_results=1))
    return os.path.exists(path)


def isdir(path: str) -> bool:
    if is_gcs(path):
        bucket, key = _split_gcs(path)
        return any(True for _ in _client().list_blobs(bucket, prefix=key.rstrip("/") + "/", max_results=1))
    return os.path.isdir(path)


def read_bytes(path: str) -> bytes:
    if is_gcs(path):
        return _blob(path).download_as_bytes()
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole file; local writes go to a temporary name and are renamed into place."""
    if is_gcs(path):
        _blob(path).upload_from_string(data)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def makedirs(path: str) -> None:
    if not is_gcs(path):
        os.makedirs(path, exist_ok=True)


def listdir(path: str) -> list[str]:
    """Names (not paths) directly under a folder, sorted."""
    if is_gcs(path):
        bucket, key = _split_gcs(path)
        prefix = key.rstrip("/") + "/" if key else ""
        names = set()
        for b in _client().list_blobs(bucket, prefix=prefix):
            names.add(b.name[len(prefix) :].split("/", 1)[0])
        return sorted(names)
    return sorted(os.listdir(path))


def glob(pattern: str) -> list[str]:
    """Files matching a glob (``*`` and ``?`` in the last component only), sorted."""
    base, _, pat = str(pattern).rpartition("/")
    if not base:
        base = "."
    if not any(c in pat for c in "*?["):
        return [pattern] if exists(pattern) else []
    return [join(base, n) for n in listdir(base) if fnmatch.fnmatch(n, pat)] if exists(base) else []


def local_path(path: str) -> str:
    """A local file-system path for ``path``: ``/gcs/`` and local paths as they are; gs:// is refused."""
    if is_gcs(path):
        raise ValueError(f"{path!r} is a gs:// URI; use the /gcs/ mount or the io helpers")
    return path
