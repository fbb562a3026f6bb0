"""Memory for embedding rows: arrays aligned to a cache line, and a pool that reuses large lookup outputs.

The table (``persia_core.embedding.table``) keeps every array in ``aligned_array`` memory, and the shard-file reader
reads into it, so a table restored from a file can keep the arrays it was read into.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import weakref

import numpy as np

CACHE_LINE = 64
"""Bytes of a CPU cache line: where every array of a table starts."""


def aligned_array(shape, dtype, fill=None) -> np.ndarray:
    """A C-contiguous array whose first byte is on a 64-byte cache-line boundary (filled with ``fill``, if given).

    numpy aligns large arrays to 16 bytes only, so a 64-byte row (dim 16, fp32) would straddle two cache lines and
    every random row access would cost two misses. ``fill=0`` takes zeroed memory from ``calloc``: a large array
    is fresh pages the kernel zeroes on first touch, so it is resident only as far as it is written (a table sized
    for its capacity costs the rows it holds)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    zero = fill is not None and fill == 0
    raw = (np.zeros if zero else np.empty)(nbytes + CACHE_LINE, dtype=np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    arr = raw[start : start + nbytes].view(dtype).reshape(shape)
    if fill is not None and not zero:
        arr.fill(fill)
    return arr


class OutputPool:
    """Reuses the memory of large lookup outputs once nothing refers to them any more.

    A fresh output of 1M rows at dim 16 is 64 MB of newly mapped pages, which the kernel zeroes on first touch just
    before the lookup overwrites them, at a cost that varies with the machine's memory state. A parameter
    server answers one lookup after another and drops each output once it is serialized, so the next output can
    take those pages, already mapped, as a caching allocator does (PyTorch's CUDA allocator; glibc returns blocks
    above 32 MiB to the kernel on every free).

    Safety: an array from ``take`` is backed by a ctypes buffer object that every view of it, and every
    ``torch.from_numpy`` of one, keeps alive (numpy and torch hold the object that exported the memory); the
    memory goes back to the pool only when that object is collected, i.e. when no array or tensor can read or
    write it any more. A caller that keeps its outputs keeps their memory, and the pool allocates anew.

    Args:
        keep: the most free buffers held, the most recently returned: at most ``keep`` recent outputs' memory
            stays allocated while no lookup runs.
        min_bytes: smaller outputs are plain allocations (malloc already reuses small blocks).
        max_bytes: larger outputs are never kept.
    """

    def __init__(self, keep: int = 2, min_bytes: int = 1 << 20, max_bytes: int = 1 << 30):
        self.keep = int(keep)
        self.min_bytes = int(min_bytes)
        self.max_bytes = int(max_bytes)
        self._free: list[np.ndarray] = []  # oldest returned first
        # buffers returned by finalizers: they may run in any thread, even inside ``take`` under the lock (the
        # cyclic garbage collector starts on any allocation), so they only append here (atomic, never blocks)
        self._returned: collections.deque[np.ndarray] = collections.deque(maxlen=self.keep)
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialized C-contiguous array of ``shape`` and ``dtype`` whose first byte is on a 64-byte
        boundary (as ``aligned_array``), in reused memory when a free buffer of 1-2x its size is held."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            return aligned_array(shape, dtype)
        need = nbytes + CACHE_LINE
        raw = None
        with self._lock:
            self._collect()
            fits = [i for i, b in enumerate(self._free) if need <= b.nbytes <= 2 * need]
            if fits:
                raw = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        if raw is None:
            raw = np.empty(need, dtype=np.uint8)
        start = -raw.ctypes.data % CACHE_LINE
        holder = (ctypes.c_char * nbytes).from_buffer(raw, start)
        weakref.finalize(holder, self._returned.append, raw).atexit = False
        return np.frombuffer(holder, dtype=dtype).reshape(shape)

    def _collect(self) -> None:
        """Move returned buffers to the free list and keep only the ``keep`` most recently returned (caller holds
        the lock), so that buffers of an old burst of large outputs do not stay for good."""
        while True:
            try:
                self._free.append(self._returned.popleft())
            except IndexError:
                break
        del self._free[: max(0, len(self._free) - self.keep)]

    @property
    def held_bytes(self) -> int:
        """Bytes of the free buffers held now."""
        with self._lock:
            self._collect()
            return sum(b.nbytes for b in self._free)
