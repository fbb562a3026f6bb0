"""Paths that may be local, ``gs://bucket/key`` URIs, or the ``/gcs/bucket/key`` mount KFP uses on Vertex AI.

Three forms, one behaviour::

    local        /tmp/x, data/movielens        the file system
    gs://b/k     Cloud Storage object URI      google-cloud-storage (honours STORAGE_EMULATOR_HOST)
    /gcs/b/k     Cloud Storage FUSE mount      the file system where /gcs/<bucket> is mounted (Vertex AI
                                               training and pipeline containers); elsewhere the same object
                                               through google-cloud-storage, as gs://b/k

Cloud Storage has no folders: a "folder" ``gs://b/d`` exists when some object's name starts with ``d/``;
``listdir`` shows the next path component of such names (files and folders alike), ``glob`` matches files
only (wildcards ``*``, ``?``, ``[...]`` in the last component). ``join`` never turns ``gs://b/x`` into
``gs:/b/x``. Writes of whole files are atomic: local ones go to a temporary name and are renamed into place,
Cloud Storage uploads replace the object in one step.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import threading
from pathlib import Path

GCS_SCHEME = "gs://"
FUSE_ROOT = "/gcs/"

_client_lock = threading.Lock()
_clients: dict[tuple, object] = {}


def is_gcs(path: str) -> bool:
    """Whether ``path`` is a ``gs://`` URI."""
    return str(path).startswith(GCS_SCHEME)


def is_fuse(path: str) -> bool:
    """Whether ``path`` is in the ``/gcs/bucket/key`` form."""
    return str(path).startswith(FUSE_ROOT)


def to_uri(path: str) -> str:
    """``/gcs/b/k`` -> ``gs://b/k``; other paths unchanged."""
    path = str(path)
    return GCS_SCHEME + path[len(FUSE_ROOT) :] if is_fuse(path) else path


def to_fuse(path: str) -> str:
    """``gs://b/k`` -> ``/gcs/b/k`` (the path a Vertex AI container sees); other paths unchanged."""
    path = str(path)
    return FUSE_ROOT + path[len(GCS_SCHEME) :] if is_gcs(path) else path


def _mounted(path: str) -> bool:
    """Whether the bucket of a ``/gcs/b/...`` path is visible in the file system (the FUSE mount)."""
    bucket = path[len(FUSE_ROOT) :].split("/", 1)[0]
    return bool(bucket) and os.path.isdir(FUSE_ROOT + bucket)


def _remote(path: str) -> str | None:
    """The ``gs://`` URI to use for ``path`` through the API, or None for file-system access."""
    path = str(path)
    if is_gcs(path):
        return path
    if is_fuse(path) and not _mounted(path):
        return to_uri(path)
    return None


def is_remote(path: str) -> bool:
    """Whether ``path`` is reached through google-cloud-storage (gs://, or /gcs/ without the mount)."""
    return _remote(path) is not None


def join(base: str, *parts: str) -> str:
    """Join path parts; keeps ``gs://`` intact (``join("gs://b", "x/", "y")`` is ``gs://b/x/y``).

    Empty parts are skipped; on Cloud Storage a part is always relative (leading slashes are dropped)."""
    base = str(base)
    if is_gcs(base):
        split_gcs(base)  # a bucket is required
        out = base.rstrip("/")
        for p in parts:
            p = str(p).strip("/")
            if p:
                out = out + ("" if out.endswith("/") else "/") + p
        return out
    return os.path.join(base, *[str(p) for p in parts if str(p)])


def split_gcs(uri: str) -> tuple[str, str]:
    """``gs://bucket/key`` -> ``(bucket, key)``; the key may be empty. Raises ``ValueError`` without a bucket."""
    uri = to_uri(uri)
    if not is_gcs(uri):
        raise ValueError(f"not a gs:// URI: {uri!r}")
    bucket, _, key = uri[len(GCS_SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"not a gs:// URI with a bucket: {uri!r}")
    return bucket, key


def gcs_client():
    """A cached ``google.cloud.storage.Client`` (anonymous against ``STORAGE_EMULATOR_HOST``)."""
    from google.cloud import storage  # type: ignore[attr-defined]  # google-cloud-storage ships no types

    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    key = (emulator, os.getpid())
    with _client_lock:
        client = _clients.get(key)
        if client is None:
            if emulator:
                from google.auth.credentials import AnonymousCredentials

                client = storage.Client(
                    project=os.environ.get("GOOGLE_CLOUD_PROJECT", "test"), credentials=AnonymousCredentials()
                )
            else:
                client = storage.Client()
            _clients[key] = client
        return client


def _blob(uri: str):
    bucket, key = split_gcs(uri)
    if not key or key.endswith("/"):
        raise IsADirectoryError(f"{uri!r} names a folder, not an object")
    return gcs_client().bucket(bucket).blob(key)


def _folder_prefix(key: str) -> str:
    return key.rstrip("/") + "/" if key.strip("/") else ""


def _has_prefix(bucket: str, prefix: str) -> bool:
    from google.api_core.exceptions import NotFound

    try:
        return any(True for _ in gcs_client().list_blobs(bucket, prefix=prefix, max_results=1))
    except NotFound:  # no such bucket
        return False


def _blobs(bucket: str, prefix: str, **kw) -> list:
    """The objects under ``prefix`` (``[]`` when the bucket does not exist)."""
    from google.api_core.exceptions import NotFound

    try:
        return list(gcs_client().list_blobs(bucket, prefix=prefix, **kw))
    except NotFound:
        return []


def exists(path: str) -> bool:
    """Whether a file or a folder (on Cloud Storage: any object under ``path/``) exists."""
    uri = _remote(path)
    if uri is None:
        return os.path.exists(path)
    return isfile(path) or isdir(path)


def isdir(path: str) -> bool:
    """Whether ``path`` is a folder (on Cloud Storage: some object's name starts with ``key/``)."""
    uri = _remote(path)
    if uri is None:
        return os.path.isdir(path)
    bucket, key = split_gcs(uri)
    if not key.strip("/"):
        return gcs_client().bucket(bucket).exists()
    return _has_prefix(bucket, _folder_prefix(key))


def isfile(path: str) -> bool:
    """Whether ``path`` is a file (an object)."""
    uri = _remote(path)
    if uri is None:
        return os.path.isfile(path)
    bucket, key = split_gcs(uri)
    return bool(key) and not key.endswith("/") and gcs_client().bucket(bucket).blob(key).exists()


def size(path: str) -> int:
    """The file's size in bytes. Raises ``FileNotFoundError`` naming the path."""
    uri = _remote(path)
    if uri is None:
        return os.path.getsize(path)
    from google.api_core.exceptions import NotFound

    blob = _blob(uri)
    try:
        blob.reload()
    except NotFound as e:
        raise FileNotFoundError(f"{path}: no such object") from e
    return int(blob.size or 0)


def read_bytes(path: str) -> bytes:
    """The whole file. Raises ``FileNotFoundError`` naming the path."""
    uri = _remote(path)
    if uri is None:
        with open(path, "rb") as f:
            return f.read()
    from google.api_core.exceptions import NotFound

    try:
        return _blob(uri).download_as_bytes()
    except NotFound as e:
        raise FileNotFoundError(f"{path}: no such object") from e


def read_state_dict(path: str) -> dict:
    """A torch-saved dict (a dense model's ``state_dict``) from ``path``, local or ``gs://``, loaded on the CPU with
    ``torch.load(..., weights_only=True)`` (no pickled code runs). Raises ``FileNotFoundError`` when absent and
    ``ValueError`` naming ``path`` when torch cannot read it (truncated, corrupt, or not a torch file)."""
    import io as _io

    import torch

    data = read_bytes(path)
    try:
        state = torch.load(_io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError, ... by what is wrong
        raise ValueError(
            f"{path}: not a readable dense-model file ({len(data)} bytes; torch.load: {type(e).__name__}: {e})"
        ) from e
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return state


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


@contextlib.contextmanager
def atomic_local_file(path: str, fsync: bool = False):
    """Write the local file ``path`` atomically: yields a binary file open for writing under a temporary name
    beside ``path``, which replaces ``path`` when the block ends without error (after an ``fsync`` when asked)
    and is removed when it raises. The temporary name has a random part and is created exclusively, never
    through a symbolic link (``O_EXCL | O_NOFOLLOW``; mode 0o666 less the umask), so a file or link planted
    under a predictable name cannot redirect the bytes elsewhere. The parent folder must exist. A failed write
    (a full disk) raises ``OSError`` naming ``path``."""
    import secrets

    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is not None:
            raise
        # a failed write or flush (disk full: ENOSPC) names no file: name the one being written
        raise OSError(e.errno, e.strerror or str(e), path) from e
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole file (parent folders are created); atomic (see module docstring)."""
    uri = _remote(path)
    if uri is not None:
        _blob(uri).upload_from_string(bytes(data), content_type="application/octet-stream")
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_local_file(path) as f:
        f.write(data)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def copy(src: str, dst: str) -> None:
    """Copy one file between any two forms (server-side when both are on Cloud Storage)."""
    s, d = _remote(src), _remote(dst)
    if s is not None and d is not None:
        sb, sk = split_gcs(s)
        db, dk = split_gcs(d)
        client = gcs_client()
        client.bucket(sb).copy_blob(client.bucket(sb).blob(sk), client.bucket(db), dk)
        return
    write_bytes(dst, read_bytes(src))


def remove(path: str) -> None:
    """Delete one file. Raises ``FileNotFoundError`` naming the path."""
    uri = _remote(path)
    if uri is None:
        os.remove(path)
        return
    from google.api_core.exceptions import NotFound

    try:
        _blob(uri).delete()
    except NotFound as e:
        raise FileNotFoundError(f"{path}: no such object") from e


def makedirs(path: str) -> None:
    """Create a local folder (and parents); a no-op on Cloud Storage, where folders need no creating."""
    if _remote(path) is None:
        os.makedirs(path, exist_ok=True)


def listdir(path: str) -> list[str]:
    """Names (not paths) directly under a folder, files and folders, sorted.

    Raises ``FileNotFoundError`` for a missing folder."""
    uri = _remote(path)
    if uri is None:
        return sorted(os.listdir(path))
    bucket, key = split_gcs(uri)
    prefix = _folder_prefix(key)
    from google.api_core.exceptions import NotFound

    names = set()
    it = gcs_client().list_blobs(bucket, prefix=prefix, delimiter="/")
    try:
        for b in it:
            name = b.name[len(prefix) :]
            if name:  # a "folder placeholder" object named exactly ``prefix`` has no name of its own
                names.add(name)
    except NotFound as e:
        raise FileNotFoundError(f"{path}: no such bucket") from e
    for p in it.prefixes:
        names.add(p[len(prefix) :].rstrip("/"))
    if not names and not exists(path):
        raise FileNotFoundError(f"{path}: no such folder")
    return sorted(names)


def walk_files(root: str) -> list[str]:
    """Relative paths (``/``-separated) of every file under ``root``, recursively, sorted."""
    uri = _remote(root)
    if uri is None:
        out = []
        for d, _, files in os.walk(root):
            out += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in files]
        return sorted(out)
    bucket, key = split_gcs(uri)
    prefix = _folder_prefix(key)
    return sorted(b.name[len(prefix) :] for b in _blobs(bucket, prefix) if not b.name.endswith("/"))


def glob(pattern: str) -> list[str]:
    """Files matching ``pattern`` (wildcards ``*``, ``?``, ``[...]`` in the last component only), sorted.

    A pattern without wildcards gives ``[pattern]`` when it exists (file or folder), else ``[]``."""
    pattern = str(pattern)
    if is_gcs(pattern) and any(c in split_gcs(pattern)[0] for c in "*?["):
        raise ValueError(f"glob {pattern!r}: wildcards in the bucket name are not supported")
    base, sep, pat = pattern.rpartition("/")
    if any(c in base for c in "*?["):
        raise ValueError(f"glob {pattern!r}: wildcards are supported in the last path component only")
    if not any(c in pat for c in "*?["):
        return [pattern] if exists(pattern) else []
    if not sep:
        base = "."
    elif not base:
        base = "/"
    uri = _remote(base)
    if uri is None:
        if not os.path.isdir(base):
            return []
        names = [n for n in os.listdir(base) if fnmatch.fnmatchcase(n, pat)]
        out = [os.path.join(base, n) if sep else n for n in names]
        return sorted(p for p in out if os.path.isfile(p))
    bucket, key = split_gcs(uri)
    prefix = _folder_prefix(key)
    # the literal part of the pattern narrows the listing
    literal = pat
    for i, c in enumerate(pat):
        if c in "*?[":
            literal = pat[:i]
            break
    out = []
    for b in _blobs(bucket, prefix + literal, delimiter="/"):
        name = b.name[len(prefix) :]
        if name and fnmatch.fnmatchcase(name, pat):
            out.append(join(base, name))
    return sorted(out)


def local_path(path: str) -> str:
    """A local file-system path for ``path``: ``/gcs/`` and local paths as they are; gs:// is refused."""
    if is_gcs(path):
        raise ValueError(f"{path!r} is a gs:// URI; use the /gcs/ mount or the io helpers")
    return path
