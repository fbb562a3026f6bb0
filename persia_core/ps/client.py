"""Embedding-worker side of the parameter servers: route IDs to shards, call them concurrently, reassemble.

An ``EmbeddingBackend`` (``persia_core.embedding.backend``), as the in-process
``persia_core.embedding.reference.LocalEmbedding`` is. IDs passed in are expected to be unique already (the
trainer deduplicates a batch once); gradients are per unique ID.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from persia_core.config import EmbeddingConfig
from persia_core.embedding.backend import EmbeddingBackend
from persia_core.embedding.routing import part_size, shard_parts, take_part
from persia_core.ps import local_channel, wire
from persia_core.ps import shm as shm_mod
from persia_core.ps.protocol import GRPC_OPTIONS, SERVICE, TOKEN_ENV, TOKEN_HEADER

log = logging.getLogger("persia.ps.client")
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
SHM_METHODS = {"Lookup", "LookupReadonly", "Push", "Contains"}
SHM_MIN_BYTES = 16384
"""Calls whose arrays are smaller go in the message even when shared memory is on."""


class ParameterServerError(RuntimeError):
    """A parameter-server call failed (after retries); the message names the shard and address."""


def put_rows(out: np.ndarray, pos: np.ndarray | slice, rows: np.ndarray) -> None:
    """``out[pos] = rows`` for ``out: float32[N, D]`` (C-contiguous), ``pos: int64[U]`` or a slice of U rows,
    ``rows: float32[U, D]``: one ``np.put`` of whole rows (viewed as D x 4-byte items), several times faster than
    fancy assignment; a slice is one copy. Raises ``ValueError`` when the shapes disagree, ``IndexError`` for a
    position out of range."""
    rows = np.ascontiguousarray(rows, dtype=out.dtype)
    n = part_size(pos)
    if rows.ndim != 2 or rows.shape != (n, out.shape[1]) or not out.flags.c_contiguous:
        raise ValueError(f"put_rows: {rows.shape} rows for {n} positions of a {out.shape} array")
    if isinstance(pos, slice):
        out[pos] = rows
        return
    if len(pos) == 0 or out.shape[1] == 0:
        return
    row = np.dtype((np.void, out.shape[1] * out.itemsize))
    np.put(out.view(row).reshape(-1), pos, rows.view(row).reshape(-1))


class EmbeddingClient:
    """gRPC client of N parameter-server shards.

    Args:
        addresses: ``host:port`` of shard 0..N-1.
        config: the embedding config (table dims).
        token: shared token sent on every call (default: ``$PERSIA_PS_TOKEN``).
        timeout_s: deadline of each attempt of a call (seconds); all attempts of a call together get 2 x timeout_s.
            retries: attempts after a retryable failure (UNAVAILABLE, DEADLINE_EXCEEDED) while that time lasts.
        delay_s, bandwidth_bytes_per_s: optional injected network cost per call (0 = off): a fixed round-trip
            delay and a bandwidth cap, to measure the regime of servers across a data-centre network.
        shared_memory: pass the arrays of Lookup/Push calls through shared memory (``persia_core.ps.shm``)
            instead of the message: ``None`` (auto) = for servers on a loopback address when ``/dev/shm`` is
            writable and no network cost is injected; a server that cannot map the segment makes the client fall
            back to messages for that shard. Where it is on, calls to a server on a loopback address also go over
            its local channel (``persia_core.ps.local_channel``) instead of gRPC, where the server offers one and
            it can be reached (else gRPC).
    """

    def __init__(
        self,
        addresses: list[str],
        config: EmbeddingConfig,
        token: str | None = None,
        timeout_s: float = 20.0,
        retries: int = 3,
        delay_s: float = 0.0,
        bandwidth_bytes_per_s: float = 0.0,
        client_id: str | None = None,
        shared_memory: bool | None = None,
    ):
        self.addresses = list(addresses)
        self.num_shards = len(addresses)
        self.dims = {t.name: t.dim for t in config.tables}
        self.timeout_s = timeout_s
        self.retries = retries
        self.delay_s = delay_s
        self.bandwidth = bandwidth_bytes_per_s
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.token = token
        self.metadata = ((TOKEN_HEADER, token),) if token else ()
        self.client_id = client_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._seq = [itertools.count() for _ in self.addresses]  # per shard: each shard sees 0, 1, 2, ...
        self.channels = [grpc.insecure_channel(a, options=GRPC_OPTIONS) for a in self.addresses]
        self.calls: dict[str, list[grpc.UnaryUnaryMultiCallable]] = {
            name: [ch.unary_unary(f"/{SERVICE}/{name}") for ch in self.channels]
            for name in ("Lookup", "LookupReadonly", "Push", "Contains", "Dump", "Load", "Stats", "Health")
        }
        if shared_memory is None:
            shared_memory = not (delay_s or bandwidth_bytes_per_s) and shm_mod.available()
            self.use_shm = [shared_memory and shm_mod.is_local(a) for a in self.addresses]
        else:
            self.use_shm = [bool(shared_memory) and shm_mod.available()] * self.num_shards
        # per shard: its local channel once found (None: not yet, or gRPC); use_local False: gRPC for good
        self.use_local = [bool(shared_memory) and local_channel.supported() and shm_mod.is_local(a) for a in addresses]
        self.local: list[local_channel.LocalChannel | None] = [None] * self.num_shards
        self._local_lock = threading.Lock()
        self.segments = [shm_mod.SegmentPool() for _ in self.addresses]
        self.pool = ThreadPoolExecutor(max_workers=max(4, 3 * self.num_shards), thread_name_prefix="ps-client")
        self.dispatcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-push")

    # ---- one call ------------------------------------------------------------------------------------
    def call(
        self,
        method: str,
        shard: int,
        meta: dict | None = None,
        arrays: dict | None = None,
        timeout_s: float | None = None,
        reply_bytes: int = 0,
        consume=None,
    ):
        """One blocking call with deadline and retries (safe: pushes carry sequence numbers). Returns
        ``(meta, arrays)`` of the answer, or ``consume(meta, arrays)`` when given (called before a shared-memory
        reply's segment is reused, so it may read the arrays in place). ``reply_bytes``: expected bytes of the
        answer's arrays (room reserved in the segment).

        Raises ``ParameterServerError`` naming the shard, its address and the gRPC status."""
        seg, clean, pool = None, True, self.segments[shard]
        nbytes = sum(np.asarray(a).nbytes + shm_mod.ALIGN for a in (arrays or {}).values())
        use_shm = bool(arrays) and self.use_shm[shard] and method in SHM_METHODS and nbytes >= SHM_MIN_BYTES

        def request() -> bytes:
            nonlocal seg
            if not use_shm:
                return wire.encode(meta, arrays)
            if seg is not None:  # a retry: the failed attempt may still be answered into the old segment
                pool.discard(seg)
            seg = pool.acquire(nbytes + reply_bytes + 4 * shm_mod.ALIGN)
            entries, off = seg.put(arrays or {})  # (use_shm: arrays were given)
            return wire.encode(
                {
                    **(meta or {}),
                    "shm": {"name": seg.name, "size": seg.size, "arrays": entries, "out": [off, seg.size - off]},
                }
            )

        try:
            try:
                req = request()
            except OSError as e:  # no room in /dev/shm: messages for this shard from now on
                log.warning("shared memory unavailable for shard %d (%s); sending arrays in messages", shard, e)
                self.use_shm[shard] = False
                use_shm, seg = False, None
                req = request()
            if self.delay_s or self.bandwidth:
                time.sleep(self.delay_s + (len(req) / self.bandwidth if self.bandwidth else 0.0))
            last = None
            # all attempts together get twice the deadline: one retry after a timed-out attempt (a slow moment
            # of the server), and quick retries of refused connections; a server that does not answer fails the
            # call within 2 x timeout_s (before: (1 + retries) x timeout_s, 2 minutes at the defaults)
            per_attempt = timeout_s or self.timeout_s
            deadline = time.monotonic() + 2 * per_attempt
            for attempt in range(self.retries + 1):
                if attempt and use_shm:
                    req = request()
                    clean = True
                try:
                    resp = self._send(method, shard, req, max(min(per_attempt, deadline - time.monotonic()), 0.001))
                    out_meta, out_arrays = wire.decode(resp)
                    if self.bandwidth:
                        time.sleep(len(resp) / self.bandwidth)
                    if "shm_out" in out_meta:
                        assert seg is not None  # the server answers into a segment only when sent one
                        out_arrays = shm_mod.views(seg.buf, out_meta.pop("shm_out"))
                        if consume is None:
                            out_arrays = {k: v.copy() for k, v in out_arrays.items()}
                    return consume(out_meta, out_arrays) if consume is not None else (out_meta, out_arrays)
                except grpc.RpcError as e:
                    last = e
                    clean = False
                    if seg is not None and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        break  # the server cannot map the segment: messages from now on
                    backoff = min(0.05 * 2**attempt, 1.0)
                    left = deadline - time.monotonic() - backoff
                    if e.code() not in RETRYABLE or attempt == self.retries or left < 0.1 * per_attempt:
                        break  # (no attempt with a sliver of a deadline)
                    time.sleep(backoff)
        except BaseException:
            clean = False
            raise
        finally:
            if seg is not None:
                if clean:
                    pool.release(seg)
                else:  # a failed or timed-out attempt may still be answered into it
                    pool.discard(seg)
        if seg is not None and last is not None and last.code() == grpc.StatusCode.FAILED_PRECONDITION:
            self.use_shm[shard] = False
            return self.call(method, shard, meta, arrays, timeout_s, reply_bytes, consume)
        assert last is not None  # every attempt returns or records its error
        raise ParameterServerError(
            f"{method} to shard {shard} at {self.addresses[shard]} failed: {last.code().name}: {last.details()}"
        )

    def _send(self, method: str, shard: int, request: bytes, timeout_s: float) -> bytes | bytearray:
        """One attempt: the answer's bytes, over the shard's local channel where there is one, else gRPC. Raises
        ``grpc.RpcError`` (``local_channel.LocalRpcError`` on the local channel)."""
        ch = self._local_channel(shard)
        if ch is None:
            return self.calls[method][shard](request, timeout=timeout_s, metadata=self.metadata)
        try:
            return ch.call(method, request, timeout_s)
        except local_channel.LocalRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:  # the server went away: find it again on the next attempt
                with self._local_lock:
                    if self.local[shard] is ch:
                        self.local[shard] = None
                ch.close()
            raise

    def _local_channel(self, shard: int) -> local_channel.LocalChannel | None:
        """The shard's local channel, connected on first use: its name comes from the server's ``Health`` answer
        (over gRPC, with the token). None where the shard is not on this host or offers none, and while its server
        does not answer (that attempt goes over gRPC, which reports the error)."""
        ch = self.local[shard]
        if ch is not None or not self.use_local[shard]:
            return ch
        with self._local_lock:
            if self.local[shard] is None and self.use_local[shard]:
                try:  # straight over gRPC: ``call`` would come back here through ``_send``
                    answer = self.calls["Health"][shard](
                        wire.encode(), timeout=min(self.timeout_s, 10.0), metadata=self.metadata
                    )
                except grpc.RpcError:
                    return None
                name = wire.decode(answer)[0].get("local")
                try:
                    if not isinstance(name, str) or not name:
                        raise OSError("the server offers no local channel")
                    self.local[shard] = local_channel.LocalChannel(name, self.token)
                except (OSError, grpc.RpcError) as e:  # another network namespace, say: gRPC for good
                    log.info("shard %d at %s: calls go over gRPC (%s)", shard, self.addresses[shard], e)
                    self.use_local[shard] = False
            return self.local[shard]

    # ---- routed batch calls ---------------------------------------------------------------------------
    def _route(self, ids: np.ndarray, bounds: np.ndarray | None = None) -> list[np.ndarray | slice]:
        """Where the IDs of each shard are in ``ids`` (``routing.shard_parts``)."""
        return shard_parts(ids, self.num_shards, bounds)

    def _gather(self, method: str, table: str, ids: np.ndarray, bounds: np.ndarray | None = None) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.empty((len(ids), self.dims[table]), dtype=np.float32)
        parts = self._route(ids, bounds)
        row_bytes = self.dims[table] * 4

        def fill(pos):
            def consume(meta, arrays):
                put_rows(out, pos, arrays["rows"])

            return consume

        futs = [
            self.pool.submit(
                self.call,
                method,
                s,
                {"table": table},
                {"ids": take_part(ids, pos)},
                None,
                part_size(pos) * row_bytes,
                fill(pos),
            )
            for s, pos in enumerate(parts)
            if part_size(pos)
        ]
        for f in futs:
            f.result()
        return out

    def lookup(self, table: str, ids: np.ndarray, bounds: np.ndarray | None = None) -> np.ndarray:
        """Rows of unique ``ids: uint64[U]`` -> ``float32[U, D]``, created where unseen. ``bounds``: ``ids`` are
        grouped by shard (``routing.group_by_shard``)."""
        return self._gather("Lookup", table, ids, bounds)

    def lookup_readonly(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids: uint64[U]`` -> ``float32[U, D]``; unseen -> zero row, nothing inserted."""
        return self._gather("LookupReadonly", table, ids)

    def push(
        self,
        table: str,
        ids: np.ndarray,
        grads: np.ndarray,
        step: int = 0,
        sync_workers: int = 0,
        step_fraction: float = 1.0,
        bounds: np.ndarray | None = None,
        lr_scale: float = 1.0,
        epochs_trained: float = 1.0,
    ) -> Future[int]:
        """Send the gradients of unique ``ids: uint64[U]`` (``grads: float32[U, D]``) to their shards without
        blocking. Returns a future that completes when every shard has applied them (``sync_workers = M > 1``:
        when the step's pushes of all M workers were combined and applied). Its result is the dropped count.
        ``bounds``: ``ids`` are grouped by shard (``routing.group_by_shard``). ``step_fraction``, ``lr_scale``,
        ``epochs_trained``: as ``EmbeddingTable.apply_gradients``."""
        out: Future[int] = Future()
        # routing and sending happen off the caller's thread, on one dispatcher thread, in call order
        self.dispatcher.submit(
            self._dispatch_push,
            out,
            table,
            ids,
            grads,
            step,
            sync_workers,
            step_fraction,
            bounds,
            lr_scale,
            epochs_trained,
        )
        return out

    def _dispatch_push(
        self,
        out: Future,
        table: str,
        ids,
        grads,
        step: int,
        sync_workers: int,
        step_fraction: float = 1.0,
        bounds: np.ndarray | None = None,
        lr_scale: float = 1.0,
        epochs_trained: float = 1.0,
    ) -> None:
        try:
            ids = np.ascontiguousarray(ids, dtype=np.uint64)
            grads = np.ascontiguousarray(grads, dtype=np.float32)
            parts = self._route(ids, bounds)
            sync = sync_workers > 1
            futs = []
            for s, pos in enumerate(parts):
                if part_size(pos) or sync:  # in sync mode every shard hears from every worker every step
                    meta = {
                        "table": table,
                        "client": self.client_id,
                        "seq": next(self._seq[s]),
                        "step": step,
                        "sync_workers": sync_workers,
                        "step_fraction": step_fraction,
                        "lr_scale": lr_scale,
                        "epochs_trained": epochs_trained,
                    }
                    arrays = {"ids": take_part(ids, pos), "grads": take_part(grads, pos)}
                    futs.append(self.pool.submit(self.call, "Push", s, meta, arrays))
        except BaseException as e:
            out.set_exception(e)
            return
        if not futs:
            out.set_result(0)
            return
        remaining = [len(futs)]
        dropped = [0]

        def done(f: Future) -> None:
            if out.done():
                return
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            dropped[0] += int(f.result()[0].get("dropped", 0))
            remaining[0] -= 1
            if remaining[0] == 0:
                out.set_result(dropped[0])

        for f in futs:
            f.add_done_callback(done)

    def contains(self, table: str, ids: np.ndarray) -> np.ndarray:
        """``bool[U]``: whether each of ``ids: uint64[U]`` has a row on its shard."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.zeros(len(ids), dtype=bool)
        for s, pos in enumerate(self._route(ids)):
            if part_size(pos):
                out[pos] = self.call("Contains", s, {"table": table}, {"ids": ids[pos]})[1]["found"].astype(bool)
        return out

    def dump(self, paths: list[str], timeout_s: float = 1800.0) -> list[tuple[int, int]]:
        """Each shard writes its state to ``paths[shard]`` (concurrently). Returns ``(bytes, CRC-32C)`` of each
        shard file as its server wrote it. ``timeout_s``: per shard (seconds)."""
        futs = [self.pool.submit(self.call, "Dump", s, {"path": p}, None, timeout_s) for s, p in enumerate(paths)]
        return [(int(f.result()[0]["bytes"]), int(f.result()[0]["crc32c"])) for f in futs]

    def load(self, paths: list[str], expected: list[tuple[int, int]] | None = None, timeout_s: float = 1800.0) -> None:
        """Each shard replaces its state with ``paths[shard]`` (concurrently), refused unless its size and
        CRC-32C equal ``expected[shard]`` (``(bytes, CRC-32C)``) when given. ``timeout_s``: per shard (seconds).
        Raises ``ValueError`` unless one path (and one expected pair) per shard, ``ParameterServerError``
        naming the shard whose server refused its file."""
        if len(paths) != self.num_shards:
            raise ValueError(f"{len(paths)} shard files for {self.num_shards} shards")
        if expected is not None and len(expected) != self.num_shards:
            raise ValueError(f"{len(expected)} expected (bytes, CRC-32C) for {self.num_shards} shards")
        metas = [
            {"path": p, **({"size": expected[s][0], "crc32c": expected[s][1]} if expected is not None else {})}
            for s, p in enumerate(paths)
        ]
        futs = [self.pool.submit(self.call, "Load", s, meta, None, timeout_s) for s, meta in enumerate(metas)]
        for f in futs:
            f.result()

    def stats(self) -> list[dict[str, Any]]:
        """Each server's ``Stats`` answer: ``{"shard", "num_shards", "tables": {name: EmbeddingTable.stats()},
        "pushes", "duplicate_pushes", "table_cpu_s", "process_cpu_s"}``."""
        return [self.call("Stats", s)[0] for s in range(self.num_shards)]

    def health(self, timeout_s: float = 5.0) -> list[dict]:
        return [self.call("Health", s, timeout_s=timeout_s)[0] for s in range(self.num_shards)]

    def flush(self) -> None:
        """Nothing buffered: each push is sent when made (its future says when it is applied)."""

    def _close_local(self) -> None:
        with self._local_lock:
            self.use_local = [False] * self.num_shards
            channels, self.local = self.local, [None] * self.num_shards
        for lc in channels:
            if lc is not None:
                lc.close()

    def close(self, cancel: bool = False) -> None:
        """Close the channels and threads. Pushes already made are sent and answered first, unless ``cancel``:
        then every call in flight is cancelled at once (it raises ``ParameterServerError``, CANCELLED), so that a
        job that is being stopped does not wait on a dump of many GB or a server that does not answer."""
        if cancel:
            self._close_local()
            for ch in self.channels:
                ch.close()  # ends every active call now
        self.dispatcher.shutdown(wait=True, cancel_futures=cancel)
        self.pool.shutdown(wait=True, cancel_futures=cancel)
        self._close_local()
        for ch in self.channels:
            ch.close()
        for pool in self.segments:
            pool.close()


if TYPE_CHECKING:  # mypy checks here that EmbeddingClient satisfies the EmbeddingBackend Protocol

    def _is_backend(backend: EmbeddingClient) -> EmbeddingBackend:
        return backend
