"""The shared-memory transport between an NN worker and its embedding workers on one host.

One segment per NN worker holds, at offset 0, ``frontier: int64[E]`` (embedding worker e has every push of its
own steps below ``frontier[e]`` applied; written by e only, read by all), ``phase_seconds: float64[E, P]``
(seconds embedding worker e spent in each of ``PHASES``; written by e only), then for each embedding worker e and
each of its R ready slots k: ``emb float32[B, S, D]`` (the pooled embeddings; the NN worker overwrites it with
d loss / d emb after the backward), ``dense float32[B, F]``, ``labels float32[B]`` (B: the batch size, the
slot's capacity), and with a wide table (``model.wide``) ``wide float32[B, S, 1]`` (its pooled weights, then
d loss / d wide; always float32). Sizes: ``ring_bytes``. A ``half`` ring (``trainer.fp16_transfer``) holds the
embeddings as ``float16[B, S, D]`` at the start of the same region (``slot_half``), converted by the embedding
worker, so that the NN worker copies them to the GPU as they are; a gradient comes back there as fp16 too (GRAD
``a`` = 1), or, where it overflows fp16, as float32 over the whole region (``a`` = 0).

Control messages (``MSG``: kind, slot, step, a, b as ``<iiqqq``; an error's UTF-8 text follows its header) go over
a Unix socket pair, one per embedding worker: embedding worker -> NN worker ``STARTED`` (set up: its data read,
its client connected), ``READY`` (slot, step, a = rows,
b = staleness) and ``ERROR`` (a = text bytes); NN worker -> embedding worker ``GRAD`` (slot, step, a = 1 for an
fp16 gradient) and ``STOP``.
End of file on the socket is the peer's death. Nothing is pickled.

The segment is a file ``/dev/shm/persia_<pid><hex>`` of the NN worker (mode 0600, the same naming and cleanup as
``persia_core.ps.shm``), or anonymous memory when the embedding workers are threads of the NN worker.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
from dataclasses import dataclass

import numpy as np

from persia_core.ps import shm

MSG = struct.Struct("<iiqqq")
READY, GRAD, ERROR, STOP, STARTED = 1, 2, 3, 4, 5
PHASES = ("read", "dedup", "wait_slot", "wait_bound", "lookup_pool", "grads", "push", "wait_fresh")
"""An embedding worker's phases: gathering the batch's rows, ID dropout and dedup, waiting for a free ready slot,
waiting for the staleness bound, lookups and pooling, per-ID gradients, issuing the pushes, and waiting for
fresher rows within the bound (``trainer.fresh_lookups``)."""
NEVER = 1 << 62
"""``frontier`` value of an embedding worker with no own step left to apply."""
SHM_SETTING = (
    "raise it: `docker run --shm-size=...`, or on Kubernetes mount an `emptyDir: {medium: Memory, sizeLimit: ...}` "
    "volume at /dev/shm; or lower trainer.embedding_workers, trainer.prefetch_threads or trainer.batch_size"
)


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


@dataclass(frozen=True)
class RingLayout:
    """Where everything lies in the segment: ``workers`` E, ``slots_per_worker`` R, ``batch`` B, ``num_slots`` S,
    ``dim`` D, ``num_dense`` F; ``half``: embeddings handed over as fp16; ``wide``: a wide table's region."""

    workers: int
    slots_per_worker: int
    batch: int
    num_slots: int
    dim: int
    num_dense: int
    half: bool = False
    wide: bool = False

    @property
    def header_bytes(self) -> int:
        return _align(8 * self.workers) + _align(8 * self.workers * len(PHASES))

    @property
    def slot_bytes(self) -> int:
        b = self.batch
        wide = _align(4 * b * self.num_slots) if self.wide else 0
        return _align(4 * b * self.num_slots * self.dim) + _align(4 * b * max(self.num_dense, 0)) + _align(4 * b) + wide

    @property
    def ring_bytes(self) -> int:
        """Bytes of the whole segment."""
        return self.header_bytes + self.workers * self.slots_per_worker * self.slot_bytes

    def frontier(self, buf: np.ndarray) -> np.ndarray:
        """``int64[E]`` view of ``buf`` (the segment's ``uint8`` view)."""
        return buf[: 8 * self.workers].view(np.int64)

    def phase_seconds(self, buf: np.ndarray) -> np.ndarray:
        """``float64[E, len(PHASES)]`` view of ``buf``."""
        off = _align(8 * self.workers)
        return buf[off : off + 8 * self.workers * len(PHASES)].view(np.float64).reshape(self.workers, len(PHASES))

    def slot(self, buf: np.ndarray, worker: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Views ``(emb float32[B, S, D], dense float32[B, F], labels float32[B])`` of slot ``k`` of ``worker``."""
        b, s, d, f = self.batch, self.num_slots, self.dim, self.num_dense
        off_emb, off_dense, off_labels, _ = self._offsets(worker, k)
        emb = buf[off_emb : off_emb + 4 * b * s * d].view(np.float32).reshape(b, s, d)
        dense = buf[off_dense : off_dense + 4 * b * f].view(np.float32).reshape(b, f)
        labels = buf[off_labels : off_labels + 4 * b].view(np.float32)
        return emb, dense, labels

    def _offsets(self, worker: int, k: int) -> tuple[int, int, int, int]:
        """Byte offsets of slot ``k`` of ``worker``'s regions: embeddings, dense, labels, wide."""
        b = self.batch
        emb = self.header_bytes + (worker * self.slots_per_worker + k) * self.slot_bytes
        dense = emb + _align(4 * b * self.num_slots * self.dim)
        labels = dense + _align(4 * b * self.num_dense)
        return emb, dense, labels, labels + _align(4 * b)

    def wide_view(self, buf: np.ndarray, worker: int, k: int) -> np.ndarray | None:
        """``float32[B, S, 1]`` view of slot ``k``'s wide region (None without one)."""
        if not self.wide:
            return None
        b, s = self.batch, self.num_slots
        off = self._offsets(worker, k)[3]
        return buf[off : off + 4 * b * s].view(np.float32).reshape(b, s, 1)

    def emb(self, buf: np.ndarray, worker: int, k: int, half: bool) -> np.ndarray:
        """Slot ``k``'s embeddings or gradient as they lie in it: ``float16[B, S, D]`` (``half``, ``slot_half``) or
        ``float32[B, S, D]``."""
        return self.slot_half(buf, worker, k) if half else self.slot(buf, worker, k)[0]

    def slot_half(self, buf: np.ndarray, worker: int, k: int) -> np.ndarray:
        """``float16[B, S, D]`` view of the start of slot ``k``'s embedding region (a ``half`` ring's embeddings,
        or an fp16 gradient)."""
        b, s, d = self.batch, self.num_slots, self.dim
        off = self._offsets(worker, k)[0]
        return buf[off : off + 2 * b * s * d].view(np.float16).reshape(b, s, d)

    @classmethod
    def from_list(cls, values: list) -> RingLayout:
        """Inverse of ``to_list`` (7 integers: no wide region). Raises ``ValueError`` for a list of another length."""
        if len(values) not in (7, 8):
            raise ValueError(f"a ring layout is 8 integers, got {values!r}")
        e, r, b, s, d, f = (int(v) for v in values[:6])
        return cls(e, r, b, s, d, f, half=bool(values[6]), wide=len(values) == 8 and bool(values[7]))

    def to_list(self) -> list[int]:
        return [
            self.workers,
            self.slots_per_worker,
            self.batch,
            self.num_slots,
            self.dim,
            self.num_dense,
            int(self.half),
            int(self.wide),
        ]


class Segment:
    """The ring's memory: a ``/dev/shm`` file (``shared``) or anonymous memory; ``buf`` is its ``uint8`` view.

    ``Segment(layout, shared=True)`` creates the file (checking the free space of ``/dev/shm`` first);
    ``Segment.attach(name, layout)`` maps an existing one (an embedding worker process). Raises ``OSError`` naming
    the setting to raise when ``/dev/shm`` is too small."""

    def __init__(self, layout: RingLayout, shared: bool, name: str | None = None):
        self.layout = layout
        self.size = max(layout.ring_bytes, mmap.PAGESIZE)
        self.owner = name is None
        self.name = ""
        self.path = ""
        if not shared:
            self.mm = mmap.mmap(-1, self.size)
        else:
            self.name = name or shm.segment_name(os.getpid())
            if not shm.NAME_RE.match(self.name):
                raise ValueError(f"not a segment name: {self.name!r}")
            self.path = os.path.join(shm.SHM_DIR, self.name)
            if not self.owner:
                self.mm = shm.open_mapping(self.path, self.size)
            else:
                self._check_space()
                try:
                    self.mm = shm.create_mapping(self.path, self.size)
                except OSError as e:
                    raise OSError(
                        e.errno,
                        f"the embedding workers' {self.size / 2**20:.0f} MiB ready ring in {shm.SHM_DIR}: {e}; "
                        + SHM_SETTING,
                    ) from e
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)

    @classmethod
    def attach(cls, name: str, layout: RingLayout) -> Segment:
        return cls(layout, shared=True, name=name)

    def _check_space(self) -> None:
        st = os.statvfs(shm.SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if free < self.size:
            raise OSError(
                28,
                f"{shm.SHM_DIR} has {free / 2**20:.0f} MiB free (of {st.f_blocks * st.f_frsize / 2**20:.0f} MiB), the "
                f"embedding workers' ready ring needs {self.size / 2**20:.0f} MiB; " + SHM_SETTING,
            )

    def close(self) -> None:
        """Unmap, and remove the file if this process created it (idempotent)."""
        self.buf = np.empty(0, dtype=np.uint8)
        shm.unmap(self.mm, self.path if self.owner else None)


class PeerGone(ConnectionError):
    """The other end of a control socket closed it (its process died or stopped)."""


def send(sock: socket.socket, kind: int, slot: int = 0, step: int = 0, a: int = 0, b: int = 0, text: str = "") -> None:
    """Send one control message (``text``: an ``ERROR``'s message)."""
    data = text.encode("utf-8")
    sock.sendall(MSG.pack(kind, slot, step, len(data) if kind == ERROR else a, b) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise PeerGone("control socket closed by its peer")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def recv(sock: socket.socket, timeout_s: float | None) -> tuple[int, int, int, int, int, str] | None:
    """The next control message ``(kind, slot, step, a, b, text)``, or None when none arrives within ``timeout_s``
    (None: wait). Raises ``PeerGone`` at end of file."""
    if timeout_s is not None:
        ready, _, _ = select.select([sock], [], [], timeout_s)
        if not ready:
            return None
    kind, slot, step, a, b = MSG.unpack(_recv_exact(sock, MSG.size))
    text = ""
    if kind == ERROR:
        text = _recv_exact(sock, a).decode("utf-8", "replace") if a else ""
    elif kind not in (READY, GRAD, STOP, STARTED):
        raise ValueError(f"control socket: unknown message kind {kind}")
    return kind, slot, step, a, b, text
