"""Wire format of parameter-server messages: a JSON header plus raw little-endian array buffers.

    b"PSW1" | uint32 header length | header JSON | array bytes ...

header = ``{"meta": {...}, "arrays": [[name, dtype, shape, offset, nbytes], ...]}``. Only the dtypes in
``ALLOWED`` are accepted, and nothing is ever unpickled, so a message from an untrusted peer can at worst be
refused with ``ValueError``.
"""

from __future__ import annotations

import json
import struct

import numpy as np

MAGIC = b"PSW1"
ALLOWED = {"uint64", "int64", "int32", "float64", "float32", "float16", "uint8"}


def encode(meta: dict | None = None, arrays: dict[str, np.ndarray] | None = None) -> bytes:
    """Serialize ``meta`` (JSON-able dict) and ``arrays`` (name -> ndarray of an allowed dtype)."""
    arrays = arrays or {}
    entries, bufs, offset = [], [], 0
    for name, arr in arrays.items():
        a = np.asarray(arr)
        if a.dtype.name not in ALLOWED:
            raise ValueError(f"array {name!r} has dtype {a.dtype}, not one of {sorted(ALLOWED)}")
        # a byte view, not a copy (unless strided or big-endian): the join below is then the only copy
        little = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), order="C", copy=False))
        b = little.reshape(-1).view(np.uint8).data
        entries.append([name, a.dtype.name, list(a.shape), offset, b.nbytes])
        bufs.append(b)
        offset += b.nbytes
    header = json.dumps({"meta": meta or {}, "arrays": entries}).encode("utf-8")
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *bufs])


def decode(data: bytes | bytearray) -> tuple[dict, dict[str, np.ndarray]]:
    """Inverse of ``encode``. Raises ``ValueError`` on a malformed message (bad magic, dtype, bounds)."""
    if len(data) < 8 or data[:4] != MAGIC:
        raise ValueError("not a parameter-server message (bad magic)")
    (hlen,) = struct.unpack("<I", data[4:8])
    if 8 + hlen > len(data):
        raise ValueError("truncated message header")
    try:
        header = json.loads(data[8 : 8 + hlen])
    except json.JSONDecodeError as e:
        raise ValueError(f"bad message header: {e}") from e
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("meta", {}), dict)
        or not isinstance(header.get("arrays", []), list)
    ):
        raise ValueError('bad message header: expected {"meta": {...}, "arrays": [...]}')
    base = 8 + hlen
    body = memoryview(data)[base:]
    arrays = {}
    for entry in header.get("arrays", []):
        if not isinstance(entry, list) or len(entry) != 5:
            raise ValueError(f"bad array entry {entry!r}: expected [name, dtype, shape, offset, nbytes]")
        name, dtype, shape, offset, nbytes = entry
        if not isinstance(name, str) or dtype not in ALLOWED:
            raise ValueError(f"array {name!r}: dtype {dtype!r} not allowed")
        if not isinstance(shape, list) or not all(_count(d) for d in shape) or not _count(offset) or not _count(nbytes):
            raise ValueError(f"array {name!r}: shape, offset and size must be integers >= 0")
        dt = np.dtype(dtype).newbyteorder("<")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count * dt.itemsize != nbytes or offset + nbytes > len(body):
            raise ValueError(f"array {name!r}: size or bounds do not match")
        arrays[name] = np.frombuffer(body, dtype=dt, count=count, offset=offset).reshape(tuple(shape))
    return header.get("meta", {}), arrays


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62
