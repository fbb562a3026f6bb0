"""CRC-32C (Castagnoli), the checksum Cloud Storage keeps per object: of buffers in place and of whole files.

The shard files, checkpoints and model manifests record the CRC-32C of every file they write, so a reader can
check a file against the figure its writer saw (``persia_core.embedding.shard_file``, the checkpoint module).
"""

from __future__ import annotations

import ctypes
import glob as _glob
import os

import numpy as np

from persia_core import io


def _native_crc32c():
    """``crc32c_extend(crc, ptr, n)`` of the library bundled with ``google-crc32c`` (hardware CRC32C), or None."""
    try:
        import google_crc32c
    except ImportError:
        return None
    base = os.path.dirname(google_crc32c.__file__)
    for path in sorted(
        _glob.glob(os.path.join(base, os.pardir, "google_crc32c.libs", "libcrc32c*"))
        + _glob.glob(os.path.join(base, "libcrc32c*"))
    ):
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return fn
    return None


_CRC32C_EXTEND = _native_crc32c()


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C of ``data`` (any C-contiguous buffer: bytes, memoryview, ndarray), continuing from ``crc``.

    Runs on the buffer in place (no copy) through the hardware CRC32C of ``google-crc32c``'s bundled library and
    releases the GIL; falls back to ``google_crc32c.extend`` on copied 8 MiB chunks."""
    mv = memoryview(data)
    if mv.nbytes == 0:
        return crc
    if not mv.c_contiguous:
        raise ValueError("crc32c needs a C-contiguous buffer")
    if _CRC32C_EXTEND is not None:
        arr = np.frombuffer(mv.cast("B"), dtype=np.uint8)
        return int(_CRC32C_EXTEND(crc, arr.ctypes.data, arr.nbytes))
    import google_crc32c

    mv = mv.cast("B")
    for i in range(0, mv.nbytes, 1 << 23):
        crc = google_crc32c.extend(crc, bytes(mv[i : i + (1 << 23)]))
    return crc


def file_crc32c(path: str, chunk: int = 1 << 24) -> tuple[int, int]:
    """``(size in bytes, CRC-32C)`` of a whole file (local, ``/gcs/`` or ``gs://``)."""
    if io.is_remote(path):
        data = io.read_bytes(path)
        return len(data), crc32c(data)
    crc, size = 0, 0
    buf = bytearray(chunk)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = crc32c(mv[:n], crc)
            size += n
    return size, crc
