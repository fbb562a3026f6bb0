"""Shared-memory path between an embedding worker and the parameter servers on its own host.

When a server and its client share a host, the arrays of Lookup/Push calls need not cross a socket: the client
writes them into a memory-mapped file under ``/dev/shm`` that it owns, and the gRPC message carries only the
header (the call, its token and deadline, and where the arrays are). The server maps the same file, reads the
IDs and gradients in place (no copy) and writes the rows it returns into the client's reply area. Everything
else is unchanged: the same handlers, sequence numbers, deadlines and errors.

Layout of one call in a segment (offsets 64-byte aligned): the request arrays, then the reply area
(``out = [offset, capacity]``). A segment is held by one call at a time (``SegmentPool``) until the caller has
copied the reply out.

Safety: a server only maps names of the form ``persia_<hex>`` under ``/dev/shm`` (no paths), checks every
offset and size against the mapped size, accepts the same dtypes as ``persia_core.ps.wire`` and never unpickles;
files are created with mode 0600 and removed by the client on ``close`` (and by the local launcher for a worker
that was killed first: names carry the creating process's pid). A server that cannot map a segment
(another host, another container) answers FAILED_PRECONDITION and the client falls back to sending the arrays
in the message for that shard.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
import uuid
from collections import OrderedDict

import numpy as np

from persia_core.ps.wire import ALLOWED

SHM_DIR = "/dev/shm"
PREFIX = "persia_"
NAME_RE = re.compile(r"^persia_[0-9a-f]{16,64}$")
ALIGN = 64
MIN_SEGMENT = 1 << 20
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


class ShmUnavailable(RuntimeError):
    """The shared-memory segment named in a call cannot be used here (not on this host, wrong name or size)."""


def available() -> bool:
    """Whether this host has a writable ``/dev/shm``."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def is_local(address: str) -> bool:
    """Whether ``host:port`` names this host's loopback interface."""
    host = address.rsplit(":", 1)[0]
    return host in LOOPBACK


def segment_name(pid: int) -> str:
    """A fresh segment name of process ``pid``: ``persia_`` + its pid (8 hex digits) + 32 random hex digits."""
    return f"{PREFIX}{pid & 0xFFFFFFFF:08x}{uuid.uuid4().hex}"


def remove_segments_of(pids) -> int:
    """Remove the segments left in ``/dev/shm`` by processes ``pids`` (killed before they could close them).
    Returns how many were removed."""
    prefixes = tuple(f"{PREFIX}{pid & 0xFFFFFFFF:08x}" for pid in pids)
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if prefixes and name.startswith(prefixes) and NAME_RE.match(name):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


def remove_orphans() -> int:
    """Remove the segments of processes that no longer exist (a job killed with SIGKILL or by the OOM killer
    cleans nothing up itself). Returns how many were removed."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if NAME_RE.match(n)]
    except OSError:
        return 0
    dead = set()
    for name in names:
        pid = int(name[len(PREFIX) : len(PREFIX) + 8], 16)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.add(pid)
        except (PermissionError, OverflowError):
            pass  # alive under another user, or not a pid of ours
    return remove_segments_of(dead) if dead else 0


def create_mapping(path: str, size: int) -> mmap.mmap:
    """Create the file ``path`` (mode 0600; it must not exist) of ``size`` bytes and map it. Its pages are reserved
    at once, so a full ``/dev/shm`` (64 MiB in a default Docker container) fails here with ``OSError``, not later
    with SIGBUS on a write into the mapping; the file is removed again on any error."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def open_mapping(path: str, size: int) -> mmap.mmap:
    """Map the first ``size`` bytes of the existing file ``path``. Raises ``ValueError`` when it is smaller."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"{path} is smaller than expected ({size} bytes)")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unmap(mm: mmap.mmap, path: str | None) -> None:
    """Close the mapping (left to the views of it still alive) and remove ``path`` when given (idempotent)."""
    try:
        mm.close()
    except (BufferError, ValueError):  # a view still alive: the mapping goes with it
        pass
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Segment:
    """One client-owned memory-mapped file in ``/dev/shm`` of ``size`` bytes (``buf``: its ``uint8`` view)."""

    def __init__(self, size: int):
        self.size = max(MIN_SEGMENT, 1 << (int(size) - 1).bit_length())
        self.name = segment_name(os.getpid())
        self.path = os.path.join(SHM_DIR, self.name)
        self.mm = create_mapping(self.path, self.size)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)

    def put(self, arrays: dict[str, np.ndarray]) -> tuple[list, int]:
        """Copy ``arrays`` into the segment from offset 0. Returns (header entries ``[name, dtype, shape, offset,
        nbytes]``, the first free aligned offset). Raises ``ValueError`` if they do not fit or a dtype is not
        allowed."""
        entries, off = [], 0
        for name, arr in arrays.items():
            a = np.ascontiguousarray(arr)
            if a.dtype.name not in ALLOWED:
                raise ValueError(f"array {name!r} has dtype {a.dtype}, not one of {sorted(ALLOWED)}")
            if off + a.nbytes > self.size:
                raise ValueError(f"array {name!r} does not fit the segment ({self.size} bytes)")
            self.buf[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
            entries.append([name, a.dtype.name, list(a.shape), off, a.nbytes])
            off = _align(off + a.nbytes)
        return entries, off

    def close(self) -> None:
        """Unmap and remove the file (idempotent)."""
        self.buf = np.empty(0, dtype=np.uint8)  # drop the view of the mapping, so that it can close
        unmap(self.mm, self.path)


def views(buf: np.ndarray, entries: list) -> dict[str, np.ndarray]:
    """Arrays described by header ``entries`` as views of ``buf`` (no copy). Raises ``ValueError`` on a bad
    dtype, shape or bounds."""
    out = {}
    for name, dtype, shape, offset, nbytes in entries:
        if dtype not in ALLOWED:
            raise ValueError(f"array {name!r}: dtype {dtype!r} not allowed")
        dt = np.dtype(dtype).newbyteorder("<")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        offset, nbytes = int(offset), int(nbytes)
        if count < 0 or count * dt.itemsize != nbytes or offset < 0 or offset % ALIGN or offset + nbytes > len(buf):
            raise ValueError(f"array {name!r}: size or bounds do not match the shared-memory segment")
        out[name] = buf[offset : offset + nbytes].view(dt).reshape(shape)
    return out


def write_reply(buf: np.ndarray, out: list, arrays: dict[str, np.ndarray]) -> list | None:
    """Copy reply ``arrays`` into the reply area ``out = [offset, capacity]`` of ``buf``. Returns the header
    entries, or None when they do not fit (the caller then sends them in the message)."""
    base, cap = _reply_area(buf, out)
    need = sum(_align(np.asarray(a).nbytes) for a in arrays.values())
    if need > cap:
        return None
    entries, off = [], base
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        if a.dtype.name not in ALLOWED:
            raise ValueError(f"array {name!r} has dtype {a.dtype}, not one of {sorted(ALLOWED)}")
        if a.nbytes and a.ctypes.data != buf.ctypes.data + off:  # not already written in place (reply_array)
            buf[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        entries.append([name, a.dtype.name, list(a.shape), off, a.nbytes])
        off = _align(off + a.nbytes)
    return entries


def reply_array(buf: np.ndarray, out: list, shape: tuple[int, ...], dtype) -> np.ndarray | None:
    """An array of ``shape`` and ``dtype`` at the start of the reply area ``out = [offset, capacity]`` of ``buf``,
    for a handler to write its first reply array in place (``write_reply`` then copies nothing). None when it does
    not fit, or the area is out of the segment's bounds (the handler then allocates, and ``write_reply`` refuses
    the area as before)."""
    try:
        base, cap = _reply_area(buf, out)
    except ValueError:
        return None
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    return buf[base : base + nbytes].view(dt).reshape(shape) if nbytes <= cap else None


def _reply_area(buf: np.ndarray, out: list) -> tuple[int, int]:
    """``(offset, capacity)`` of the reply area ``out`` of ``buf``; ``ValueError`` when it is out of bounds."""
    base, cap = int(out[0]), int(out[1])
    if base < 0 or base % ALIGN or cap < 0 or base + cap > len(buf):
        raise ValueError("reply area out of the shared-memory segment's bounds")
    return base, cap


class SegmentPool:
    """Client side: reusable segments, one per call in flight (created on demand, doubled when too small)."""

    def __init__(self):
        self.free: list[Segment] = []
        self.all: list[Segment] = []
        self.lock = threading.Lock()

    def acquire(self, nbytes: int) -> Segment:
        """A segment of at least ``nbytes`` bytes, held until ``release``."""
        with self.lock:
            for i, seg in enumerate(self.free):
                if seg.size >= nbytes:
                    return self.free.pop(i)
        seg = Segment(nbytes)
        with self.lock:
            self.all.append(seg)
        return seg

    def release(self, seg: Segment) -> None:
        with self.lock:
            self.free.append(seg)

    def discard(self, seg: Segment) -> None:
        """Remove a segment instead of reusing it: after a call that failed or timed out, the server may still
        be writing its reply there."""
        with self.lock:
            if seg in self.all:
                self.all.remove(seg)
        seg.close()

    def close(self) -> None:
        """Remove every segment (call once no call is in flight)."""
        with self.lock:
            segs, self.all, self.free = self.all, [], []
        for seg in segs:
            seg.close()


class SegmentCache:
    """Server side: the clients' segments mapped so far, by name (most recently used kept, ``max_open`` at most)."""

    def __init__(self, max_open: int = 64):
        self.max_open = max_open
        self.maps: OrderedDict[str, tuple[mmap.mmap, np.ndarray]] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, name: str, size: int) -> np.ndarray:
        """The ``uint8[size]`` view of segment ``name``. Raises ``ShmUnavailable`` when the name is not a
        segment name, the file is missing (another host) or its size differs."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ShmUnavailable(f"{name!r} is not a shared-memory segment name")
        size = int(size)
        path = os.path.join(SHM_DIR, name)
        with self.lock:
            hit = self.maps.get(name)
            if hit is not None and len(hit[1]) == size:
                # a segment truncated since it was mapped would kill this process (SIGBUS) on the first access
                try:
                    intact = os.stat(path, follow_symlinks=False).st_size >= size
                except OSError:
                    intact = False
                if intact:
                    self.maps.move_to_end(name)
                    return hit[1]
                del self.maps[name]
                raise ShmUnavailable(f"shared-memory segment {name} is no longer {size} bytes")
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise ShmUnavailable(f"cannot open shared-memory segment {name}: {e.strerror}") from None
        try:
            if os.fstat(fd).st_size != size:
                raise ShmUnavailable(f"shared-memory segment {name} is not {size} bytes")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        buf = np.frombuffer(mm, dtype=np.uint8)
        with self.lock:
            self.maps[name] = (mm, buf)
            while len(self.maps) > self.max_open:
                self.maps.popitem(last=False)  # unmapped once no view of it is left
        return buf
