"""Storage roots: the only folders or ``gs://`` prefixes a parameter server's ``Dump`` and ``Load`` may reach.

A leaf module (``persia_core.io`` and the standard library): the server checks every request's path with
``check_storage_path``; the launchers and the CLIs validate roots with ``resolve_storage_roots`` before starting
a server.
"""

from __future__ import annotations

import os

from persia_core import io


def resolve_storage_roots(roots: list[str] | None) -> list[str]:
    """The storage roots a server checks against, resolved once at start: local folders with symbolic links
    followed (``os.path.realpath``; a root created later as a link leads nowhere new), ``gs://`` prefixes as
    given without a trailing slash; ``gs://b/p`` and ``/gcs/b/p`` (Cloud Storage FUSE) each bring the other form.
    None or []: no roots (any path).

    Raises ``TypeError`` for a single string instead of a list, ``ValueError`` for an empty root or a URL of any
    other scheme (the storage layer writes only local paths and ``gs://``)."""
    if roots is None:
        return []
    if isinstance(roots, (str, bytes)):
        raise TypeError(f"storage roots must be a list of paths, not one string ({roots!r})")
    out = []
    for r in roots:
        if not isinstance(r, str) or not r.strip():
            raise ValueError(f"storage root {r!r}: give a folder or a gs:// prefix, not an empty value")
        if "://" in r:
            if not r.startswith("gs://") or len(r.rstrip("/")) <= len("gs://"):
                raise ValueError(f"storage root {r!r}: only local folders and gs://bucket[/prefix] are supported")
            r = r.rstrip("/")
            out += [r, io.to_fuse(r)]  # the same objects through Cloud Storage FUSE
        else:
            real = os.path.realpath(r)
            out.append(real)
            if io.is_fuse(real) and len(real) > len(io.FUSE_ROOT):
                out.append(io.to_uri(real))
    return list(dict.fromkeys(out))


def check_storage_path(path, roots: list[str]) -> str:
    """The path a ``Dump`` or ``Load`` request may use, given ``roots`` from ``resolve_storage_roots``: ``path``
    itself (a ``gs://`` URL) or, for a local path, its resolved form (symbolic links followed), provided it lies
    strictly under one of the roots. No roots: any path.

    Raises ``ValueError`` when ``path`` is not a non-empty string; ``PermissionError`` naming the path (and what
    it resolves to) and the roots when it is outside them, is a root itself, or is a URL with ``.`` or ``..``
    segments."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"path must be a non-empty string, got {path!r}")
    if not roots:
        return path
    where = path
    if "://" in path:
        if any(seg in (".", "..") for seg in path.split("://", 1)[1].split("/")):
            raise PermissionError(f"storage path {path!r} has '.' or '..' segments")
        if any("://" in r and path.startswith(r + "/") and path.rstrip("/") != r for r in roots):
            return path
    else:
        where = os.path.realpath(path)
        for root in roots:
            if "://" not in root and where != root and os.path.commonpath([where, root]) == root:
                return where
    shown = f"{path!r}" + (f" (resolves to {where!r})" if where != path else "")
    raise PermissionError(f"storage path {shown} is not inside this server's storage roots ({', '.join(roots)})")
