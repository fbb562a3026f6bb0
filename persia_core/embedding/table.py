"""The in-process embedding table: feature ID -> row + optimizer state, created on demand, LRU-evicted at capacity.

This is the reference the distributed parameter servers are tested against (the server wraps one table per
embedding table name; the table never imports gRPC). All per-ID work runs in compiled code
(``persia_core.embedding.kernels``); the Python here only sizes arrays.

Memory per row: ``persia_core.memory`` counts what this table allocates (``bytes_per_row``). The arrays are sized
for the capacity from the start, in zeroed memory that becomes resident as rows are written: a table's resident
memory follows the rows it holds, up to the estimate at capacity, and never holds two copies of its arrays.

Storage precision: ``fp32`` (default), or ``fp16`` / ``bf16`` (IEEE half, bfloat16), held as 16-bit patterns;
every optimizer step computes in fp32 and rounds the result to nearest-even for storage; optimizer state
stays fp32.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from persia_core.config import OptimizerConfig
from persia_core.embedding import kernels as K
from persia_core.embedding.buffers import CACHE_LINE, OutputPool, aligned_array
from persia_core.embedding.precision import decode, encode
from persia_core.memory import STORAGE_BYTES, bytes_per_row, index_slots, state_shapes

_NO_WEIGHTS = np.zeros((1, 1), dtype=np.float32)  # the lookup kernel's weights argument when it does not fill


def _streamable(out: np.ndarray, weights: np.ndarray) -> bool:
    """Whether rows of ``weights: float32[R, D]`` can be copied into ``out: float32[N, D]`` with 64-byte
    non-temporal row stores (``kernels.gather_rows``): both C-contiguous, ``out`` 64-byte aligned, D a multiple
    of 16."""
    return (
        out.ctypes.data % CACHE_LINE == 0
        and out.shape[1] % 16 == 0
        and out.flags.c_contiguous
        and weights.flags.c_contiguous
        and weights.dtype == np.float32
    )


def take(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``a[rows]``, a new array, by ``stacked`` (a compiled take that releases the GIL: a table's state taken beside
    serving would otherwise stall its requests)."""
    return stacked([(a, rows)])


def stacked(pieces: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """``np.concatenate([a[rows] for a, rows in pieces])``: arrays of one dtype and row shape copied by a compiled
    take that releases the GIL (numpy's indexing and concatenation hold it for the whole copy)."""
    first = pieces[0][0]
    if any(a.dtype != first.dtype or a.shape[1:] != first.shape[1:] for a, _ in pieces):
        return np.concatenate([a[rows] for a, rows in pieces])
    width = int(np.prod(first.shape[1:], dtype=np.int64))
    out = np.empty((sum(len(rows) for _, rows in pieces), *first.shape[1:]), dtype=first.dtype)
    flat = out.reshape(len(out), width)
    at = 0
    for a, rows in pieces:
        src = np.ascontiguousarray(a).reshape(len(a), width)
        K.take_rows(src, np.ascontiguousarray(rows, dtype=np.int64), flat[at : at + len(rows)])
        at += len(rows)
    return out


def copy_into(dst: np.ndarray, src: np.ndarray, n: int) -> None:
    """``dst[:n] = src`` for ``src: T[n, ...]`` rows of ``dst``'s shape (``dst`` C-contiguous), by a compiled copy
    that releases the GIL (numpy's assignment holds it for the whole copy). Raises ``ValueError`` when ``src``
    is not ``n`` such rows."""
    src = np.asarray(src)
    if src.shape != (n, *dst.shape[1:]) or n > len(dst):
        raise ValueError(f"an array of shape {src.shape} where {(n, *dst.shape[1:])} fits")
    width = int(np.prod(dst.shape[1:], dtype=np.int64))
    K.copy_rows(np.ascontiguousarray(src, dtype=dst.dtype).reshape(n, width), dst[:n].reshape(n, width))


class EmbeddingTable:
    """Feature ID -> embedding row and optimizer state, in contiguous arrays, with LRU eviction at capacity.

    Args:
        dim: embedding dim D.
        optimizer: the server-side optimizer (``OptimizerConfig``).
        capacity: the most rows held; beyond it the least recently looked-up rows are evicted.
        init_scale: initial rows are uniform in [-init_scale, init_scale], seeded by the feature ID and ``seed``.
        seed: seed of the per-ID initializer.
        admit_probability: an unseen ID gets a row with this probability per sighting (PERSIA's
            ``admit_probability``); refused IDs read the zero row.
        admit_after_sightings: an unseen ID gets a row only from its N-th sighting on (0 = at once), counted in a
            fixed 1 MiB sketch of uint8 counters (an ID may be admitted early on a hash collision, never late).
        expire_after_steps: rows not looked up for this many lookup batches are removed (0 = never), so a table
            warm-started every day does not only grow.
        storage: weight precision, ``fp32``, ``fp16`` or ``bf16`` (see the module docstring).

    Thread safety: every public method takes the table's lock.
    """

    def __init__(
        self,
        dim: int,
        optimizer: OptimizerConfig,
        capacity: int,
        init_scale: float = 0.01,
        seed: int = 0,
        admit_probability: float = 1.0,
        admit_after_sightings: int = 0,
        expire_after_steps: int = 0,
        storage: str = "fp32",
    ):
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if storage not in STORAGE_BYTES:
            raise ValueError(f"storage must be one of {sorted(STORAGE_BYTES)}, got {storage!r}")
        self.storage = storage
        self.wdtype = np.float32 if storage == "fp32" else np.uint16
        self.dim = dim
        self.optimizer = optimizer
        self.capacity = int(capacity)
        self.init_scale = float(init_scale)
        self.seed = int(seed)
        self.step = 0
        self.dropped_gradients = 0
        if not 0.0 < admit_probability <= 1.0:
            raise ValueError(f"admit_probability must be in (0, 1], got {admit_probability}")
        if admit_after_sightings < 0 or admit_after_sightings > 255 or expire_after_steps < 0:
            raise ValueError("admit_after_sightings must be in [0, 255] and expire_after_steps >= 0")
        self.admit_probability = float(admit_probability)
        self.admit_after = int(admit_after_sightings)
        self.expire_after_steps = int(expire_after_steps)
        self.sketch = np.zeros(1 << 20 if self.admit_after > 0 else 1, dtype=np.uint8)
        self.refused = np.zeros(1, dtype=np.int64)
        self.expired = 0
        self.lock = threading.Lock()
        self.frozen = False  # read-only for good (``freeze``): readers then take no lock
        self._outputs = OutputPool()
        self._alloc(self.capacity)
        self.counters = np.zeros(4, dtype=np.int64)  # size, evictions, inserts, misses
        # keys of the rows evicted or expired since the last take_evicted (log_evictions turns it on; empty: off)
        self._evicted = np.zeros(0, dtype=np.uint64)
        self._n_evicted = np.zeros(1, dtype=np.int64)

    # ---- storage -------------------------------------------------------------------------------------
    def _alloc(self, rows: int) -> None:
        """Arrays for ``rows`` rows (the capacity): zeroed memory that is resident only as far as rows are written
        (``aligned_array``), so a table never grows, nor holds its arrays twice; the hash index (-1 = empty) is
        written whole."""
        self.keys = aligned_array(rows, np.uint64, 0)
        self.weights = aligned_array((rows, self.dim), self.wdtype, 0)
        self.last_used = aligned_array(rows, np.int32, 0)
        self.qrow = aligned_array(K.queue_size(rows), np.int32, 0)  # recency queue (see kernels)
        self.qstep = aligned_array(K.queue_size(rows), np.int32, 0)
        self.qht = np.zeros(2, dtype=np.int64)
        self.state = {
            name: aligned_array((rows, *shape), dt, 0)
            for name, (shape, dt) in state_shapes(self.optimizer.name, self.dim).items()
        }
        self.index = aligned_array(index_slots(rows), np.int32)
        K.rebuild_index(self.index, self.keys, K.shift_of(self.index), 0)  # all empty (-1), without the GIL

    def _reset_state(self, rows: np.ndarray) -> None:
        if len(rows):
            for name, arr in self.state.items():
                arr[rows] = self.optimizer.initial_accumulator if name == "acc" else 0

    # ---- API -----------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Rows held now."""
        return int(self.counters[0])

    def freeze(self) -> None:
        """Make the table read-only for good (a served model's): reads (``lookup_readonly``, ``contains``,
        ``state_dict``, ``stats``) no longer take the lock, so a long read, such as the state a server copies to
        apply deltas, does not hold up the lookups of requests. Changes raise ``RuntimeError`` from then on."""
        with self.lock:
            self.frozen = True

    def writable(self, what: str) -> None:
        """Raise ``RuntimeError`` naming ``what`` when the table is frozen."""
        if self.frozen:
            raise RuntimeError(f"{what}: the embedding table is frozen (read-only)")

    def _reading(self):
        """The lock, or nothing to hold for a frozen table (its arrays never change)."""
        return contextlib.nullcontext() if self.frozen else self.lock

    def lookup(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids: uint64[N]`` as ``float32[N, D]``, creating unseen IDs (deterministic init); written into
        ``out`` (C-contiguous ``float32[N, D]``: a server's shared-memory reply, say) when given, and returned.

        Duplicates are fine (each gets the row). At capacity, least recently used rows are evicted. Raises
        ``ValueError`` when ``out`` does not fit.
        """
        self.writable("lookup")
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = self._output(len(ids), out)
        with self.lock:
            self.step += 1
            if self.expire_after_steps:
                self._expire(self.step - self.expire_after_steps)
            if len(self._evicted) and int(self._n_evicted[0]) + len(ids) > len(self._evicted):
                self._grow_eviction_log(len(ids))  # room for every ID of the batch to evict a row
            fill = self.storage == "fp32"
            rows = np.empty(len(ids), dtype=np.int32)
            created = K.lookup(
                ids,
                True,
                self.index,
                self.keys,
                self.weights if fill else _NO_WEIGHTS,
                self.qrow,
                self.qstep,
                self.qht,
                self.counters,
                self.capacity,
                self.step,
                self.last_used,
                self.seed,
                self.init_scale,
                out,
                self.admit_probability,
                self.admit_after,
                self.sketch,
                self.refused,
                fill,
                rows,
                _streamable(out, self.weights),
                self._evicted,
                self._n_evicted,
            )
            self._reset_state(created)
            if not fill:
                if len(created):
                    init = K.init_rows(self.keys[created], self.seed, self.init_scale, self.dim)
                    self.weights[created] = encode(init, self.storage)
                self._gather(rows, out)
        return out

    def _expire(self, older_than: int) -> int:
        """Remove rows last looked up before step ``older_than`` (caller holds the lock). Returns how many."""
        if older_than <= 0:
            return 0
        lru = K.first_live(self.qrow, self.qstep, self.qht, self.last_used)
        if lru < 0 or self.last_used[lru] >= older_than:
            return 0
        removed, moves, keys = K.expire(
            older_than, self.index, self.keys, self.qrow, self.qstep, self.qht, self.counters, self.last_used
        )
        if len(self._evicted) and len(keys):
            self._grow_eviction_log(len(keys))
            n = int(self._n_evicted[0])
            self._evicted[n : n + len(keys)] = keys
            self._n_evicted[0] = n + len(keys)
        if len(moves):
            K.apply_moves(moves, self.weights)
            for arr in self.state.values():
                K.apply_moves(moves, arr)
        self.expired += int(removed)
        return int(removed)

    def log_evictions(self) -> None:
        """Start logging the keys of the rows evicted (at capacity) or expired, for ``take_evicted``: a delta's
        tombstones (``embedding.delta``). Costs 8 bytes per row removed between two takes."""
        self.writable("log_evictions")
        with self.lock:
            if not len(self._evicted):
                self._evicted = np.zeros(4096, dtype=np.uint64)

    def take_evicted(self) -> np.ndarray:
        """``uint64[E]``: the keys of the rows evicted or expired since the last call (in order, a key again if
        it was removed again after being recreated); empty unless ``log_evictions`` was called."""
        with self.lock:
            n = int(self._n_evicted[0])
            keys = self._evicted[:n].copy()
            self._n_evicted[0] = 0
        return keys

    def _grow_eviction_log(self, more: int) -> None:
        """Room in the eviction log for ``more`` keys beyond those held (caller holds the lock)."""
        n = int(self._n_evicted[0])
        if n + more > len(self._evicted):
            log = np.zeros(max(2 * len(self._evicted), n + more), dtype=np.uint64)
            log[:n] = self._evicted[:n]
            self._evicted = log

    def expire(self, older_than_steps: int) -> int:
        """Remove rows not looked up in the last ``older_than_steps`` lookup batches. Returns how many."""
        self.writable("expire")
        with self.lock:
            return self._expire(self.step - older_than_steps)

    def _output(self, n: int, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            return self._outputs.take((n, self.dim), np.float32)
        if out.shape != (n, self.dim) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(
                f"lookup output is {out.dtype}{list(out.shape)}, expected C-contiguous float32[{n}, {self.dim}]"
            )
        return out

    def lookup_readonly(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids: uint64[N]`` as ``float32[N, D]``; an unseen ID gets the zero row and is not inserted;
        ``out`` as ``lookup``'s.

        Does not change recency either (evaluation must not perturb the table)."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = self._output(len(ids), out)
        with self._reading():
            rows = K.find_rows(ids, self.index, self.keys)
            self._gather(rows, out)
        return out

    def _gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[t] = row rows[t]`` as float32, zeros where ``rows[t] < 0`` (compiled for fp32 storage)."""
        if self.storage == "fp32":
            K.gather_rows(self.weights, rows, out, _streamable(out, self.weights))
            return
        out[:] = decode(self.weights[np.maximum(rows, 0)], self.storage)
        out[rows < 0] = 0.0

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """``bool[N]``: whether each ID has a row."""
        with self._reading():
            return K.find_rows(np.ascontiguousarray(ids, dtype=np.uint64), self.index, self.keys) >= 0

    def apply_gradients(
        self,
        ids: np.ndarray,
        grads: np.ndarray,
        step_fraction: float = 1.0,
        lr_scale: float = 1.0,
        epochs_trained: float = 1.0,
    ) -> int:
        """Apply one optimizer step to the rows of ``ids: uint64[N]`` with ``grads: float32[N, D]``.

        ``step_fraction``: the share of a training step this push carries (1/M for each of M asynchronous
        workers' pushes). The scale-invariant optimizers (Adagrad, row-wise Adagrad, Adam) normalize a
        gradient's size away, so they scale their step size by it, and M pushes of a step move a row about as far
        as one synchronous update; SGD needs no scaling (the gradient itself is 1/M of the step's); FTRL adds the
        push's squared gradient divided by it to its accumulator, so that M pushes add what one update adds.
        ``lr_scale``: multiplies the optimizer's learning rate (FTRL's alpha), every optimizer alike
        (``trainer.embedding_lr_decay``). ``epochs_trained``: the epochs the run has trained (fractional): FTRL's L2
        is ``max(l2, l2_per_epoch * epochs_trained)``; the other optimizers do not use it.

        Gradients of an ID repeated in ``ids`` are summed first and applied in one update. A gradient for an ID
        that has no row (evicted since its lookup) is dropped and counted. Returns the number dropped.
        Raises ``ValueError`` on mismatched shapes or non-finite gradients.
        """
        self.writable("apply_gradients")
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if grads.shape != (len(ids), self.dim):
            raise ValueError(f"grads has shape {grads.shape}, expected ({len(ids)}, {self.dim})")
        if len(ids) == 0:
            return 0
        uniq, summed, finite = K.segment_sum(ids, grads)
        if not finite:
            raise ValueError("gradient push contains inf or NaN; refused")
        fraction, scale, epochs = float(step_fraction), float(lr_scale), float(epochs_trained)
        with self.lock:
            rows = K.find_rows(uniq, self.index, self.keys)
            dropped = int((rows < 0).sum())
            self.dropped_gradients += dropped
            if self.storage == "fp32":
                self._step(rows, summed, self.weights, self.state, fraction, scale, epochs)
            else:  # 16-bit storage: gather the rows (unique) as fp32, step, round back
                have = rows >= 0
                r = rows[have]
                w = decode(self.weights[r], self.storage).copy()
                st = {k: v[r] for k, v in self.state.items()}
                self._step(np.arange(len(r), dtype=np.int32), summed[have], w, st, fraction, scale, epochs)
                self.weights[r] = encode(w, self.storage)
                for k, v in st.items():
                    self.state[k][r] = v
        return dropped

    def _step(self, rows, grads, weights, state, fraction: float, scale: float = 1.0, epochs: float = 1.0) -> None:
        o = self.optimizer
        base = o.lr * scale
        lr = base * fraction  # scale-invariant optimizers take `fraction` of a step (apply_gradients)
        if o.name == "sgd":
            K.apply_sgd(rows, grads, weights, base, o.weight_decay)
        elif o.name == "ftrl":
            l2 = max(o.l2, o.l2_per_epoch * epochs)
            K.apply_ftrl(
                rows, grads, weights, state["acc"], state["z"], base, o.eps, o.l1, l2, o.weight_decay, fraction
            )
        elif o.name == "rowwise_adagrad":
            K.apply_rowwise_adagrad(rows, grads, weights, state["acc"], lr, o.eps, o.weight_decay)
        elif o.name == "adagrad":
            K.apply_adagrad(rows, grads, weights, state["acc"], lr, o.eps, o.weight_decay)
        else:
            K.apply_adam(
                rows,
                grads,
                weights,
                state["m"],
                state["v"],
                state["steps"],
                lr,
                o.beta1,
                o.beta2,
                o.eps,
                o.weight_decay,
            )

    def stats(self) -> dict:
        """Rows, capacity, evictions, inserts, read-only misses, dropped gradients, bytes allocated."""
        with self._reading():
            allocated = (
                self.keys.nbytes
                + self.weights.nbytes
                + self.qrow.nbytes
                + self.qstep.nbytes
                + self.last_used.nbytes
                + self.index.nbytes
                + sum(a.nbytes for a in self.state.values())
            )
            return {
                "rows": int(self.counters[0]),
                "capacity": self.capacity,
                "evictions": int(self.counters[1]),
                "inserts": int(self.counters[2]),
                "readonly_misses": int(self.counters[3]),
                "dropped_gradients": self.dropped_gradients,
                "bytes_allocated": int(allocated + self.sketch.nbytes),
                "not_admitted": int(self.refused[0]),
                "expired": self.expired,
                "bytes_per_row": bytes_per_row(self.optimizer.name, self.dim, self.capacity, self.storage),
                "storage": self.storage,
            }

    def state_dict(self) -> dict[str, np.ndarray]:
        """Rows and optimizer state, most recently used first: ``keys uint64[R]``, ``weights float32[R, D]``,
        ``last_used int32[R]`` and one array per optimizer state (``acc``, ``m``, ``v``, ``steps``)."""
        with self._reading():
            size = self.size
            order = K.queue_order(self.qrow, self.qstep, self.qht, self.last_used, size)[::-1]
            out = {"keys": take(self.keys, order), "weights": take(self.weights, order)}
            out["last_used"] = take(self.last_used, order)
            for name, arr in self.state.items():
                out[name] = take(arr, order)
            return out

    def load_state_dict(self, sd: dict[str, np.ndarray]) -> None:
        """Replace the contents with a ``state_dict()`` (rows in recency order, most recent first).

        Raises ``ValueError`` when dims, optimizer state or row count do not fit this table, ``RuntimeError`` when
        it is frozen."""
        self.writable("load_state_dict")
        keys = np.asarray(sd["keys"], dtype=np.uint64)
        n = len(keys)
        if n > self.capacity:
            raise ValueError(f"state has {n} rows, more than this table's capacity {self.capacity}")
        if sd["weights"].shape != (n, self.dim):
            raise ValueError(f"state weights have shape {sd['weights'].shape}, expected ({n}, {self.dim})")
        if sd["weights"].dtype != self.wdtype:
            raise ValueError(
                f"state weights are {sd['weights'].dtype}, this table stores {self.storage} "
                f"({np.dtype(self.wdtype).name})"
            )
        expected = set(state_shapes(self.optimizer.name, self.dim))
        present = set(sd) - {"keys", "weights", "last_used"}
        if present != expected:
            raise ValueError(
                f"optimizer state arrays {sorted(present)} do not match {self.optimizer.name}: {sorted(expected)}"
            )
        shapes = {name: (n, *shape) for name, (shape, _) in state_shapes(self.optimizer.name, self.dim).items()}
        shapes["last_used"] = (n,)
        for name, shape in shapes.items():
            if name in sd and np.shape(sd[name]) != shape:
                raise ValueError(f"state {name} has shape {np.shape(sd[name])}, expected {shape}")
        if n > 1 and len(K.dedup(np.ascontiguousarray(keys))[0]) != n:  # checked before anything is replaced
            raise ValueError("state has duplicate keys")
        with self.lock:
            self._alloc(self.capacity)
            copy_into(self.keys, keys, n)
            copy_into(self.weights, sd["weights"], n)
            copy_into(self.last_used, sd.get("last_used", np.zeros(n, np.int32)), n)
            for name in expected:
                copy_into(self.state[name], sd[name], n)
            K.queue_from_order(
                np.arange(n - 1, -1, -1, dtype=np.int32), self.last_used, self.qrow, self.qstep, self.qht
            )
            self.counters[:] = 0
            self.counters[0] = n
            self._n_evicted[0] = 0  # rows removed before do not concern the loaded table (its deltas list live keys)
            self.step = int(self.last_used[:n].max()) if n else 0
            K.rebuild_index(self.index, self.keys, K.shift_of(self.index), n)
