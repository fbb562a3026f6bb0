"""The network transport between an NN worker and its embedding workers on other hosts: one gRPC stream each.

Each embedding worker process (``python -m persia_core.train.embedding_worker --listen HOST:PORT``) serves one
bidirectional stream, ``/persia.EmbeddingWorker/Feed``; its NN worker opens it. Both ends keep a ready ring of the
same ``RingLayout`` (``persia_core.train.ready_ring``) in their own memory, and a bridge thread on each side turns
ring slots and control messages into stream messages and back, so ``EmbeddingWorker`` and ``Feeders`` are the same
code as on one host. Messages are ``persia_core.ps.wire`` (a JSON header and raw arrays; nothing is unpickled)::

    NN worker -> embedding worker
        spec        {config, data, world, counts, rank, index, start, addresses, layout, frontier, client_id}
                    (the first message: what the embedding worker needs; it reads its NN worker's share of the
                    data itself, from ``data``)
        grad        {slot, step}           grad float32 or float16[b, S, D]  (d loss / d pooled embeddings),
                                           wide float32[b, S, 1]  (d loss / d wide; a wide ring only)
        frontier    {}                     frontier int64[E]      (the other embedding workers' frontiers)
        stop        {}
    embedding worker -> NN worker
        started     {}
        ready       {slot, step, rows, staleness, frontier}   emb float32[b, S, D] (float16: a half ring),
                                                             dense float32[b, F],
                                                             labels float32[b], phase float64[P],
                                                             wide float32[b, S, 1] (a wide ring only)
        frontier    {frontier}             phase float64[P]       (after a push of its own steps is applied)
        error       {text}

Bytes per sample on the wire: ``4 * (S * D + F + 1)`` towards the NN worker and ``4 * S * D`` back (S slots of
dim D, F dense features; ``4 * S`` more each way with a wide table), plus a few hundred bytes of header per batch
(``wire_bytes_per_sample``); with
``trainer.fp16_transfer`` (a half ring) the embeddings and gradients take 2 bytes a value instead of 4.

The staleness bound stays exact: an embedding worker sees the others' frontiers as its NN worker last relayed
them, never ahead of the truth (frontiers only grow), so it may wait longer than on one host, never less.

Security: with a token (``$PERSIA_PS_TOKEN``, the job's) every stream must carry it in the ``x-persia-token``
metadata, else it is refused with UNAUTHENTICATED; a server bound beyond loopback refuses to start without one.
Failures: a stream that breaks (the process died, the host vanished: gRPC keepalive pings every 10 s) fails the
NN worker's next wait within about 20 s, naming the embedding worker and its address; an NN worker that goes away
ends its embedding worker's process.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import queue
import socket
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from persia_core.ps import wire
from persia_core.ps.protocol import GRPC_OPTIONS, TOKEN_HEADER
from persia_core.ps.servicer import bind_port
from persia_core.train import ready_ring as rr

log = logging.getLogger("persia.ready_stream")

SERVICE = "persia.EmbeddingWorker"
FEED = f"/{SERVICE}/Feed"
KEEPALIVE_S = 10.0
"""Seconds between keepalive pings on a stream, and how long an unanswered ping may wait: a peer that stops
answering (its host gone, its process stopped) is found within about twice this."""
SPEC_TIMEOUT_S = 30.0
"""How long an embedding worker waits for a new stream's spec before it refuses the stream."""


def keepalive_options(interval_s: float, server: bool) -> list[tuple[str, int]]:
    """gRPC options of either end of a stream: a ping every ``interval_s`` whether or not messages flow, a ping
    unanswered after ``interval_s`` ends the stream; a server lets the client ping that often (at half the
    interval, so a client's pings are never taken for abuse, which gRPC answers with GOAWAY "too_many_pings")."""
    ms = max(1, int(interval_s * 1000))
    opts = [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.ping_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if server:
        opts.append(("grpc.http2.min_ping_interval_without_data_ms", max(1, ms // 2)))
    return GRPC_OPTIONS + opts


def parse_listen(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port). Raises ``ValueError`` naming the address."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {address!r}: expected HOST:PORT, e.g. 127.0.0.1:0 or 0.0.0.0:2222")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def wire_bytes_per_sample(
    num_slots: int, dim: int, num_dense: int, half: bool = False, wide: bool = False
) -> dict[str, int]:
    """Array bytes per sample of the network transport: ``{"to_nn_worker", "to_embedding_worker"}``; ``half``:
    embeddings and gradients as fp16; ``wide``: a wide table's weights and gradients (float32) too."""
    e = (2 if half else 4) * num_slots * dim + (4 * num_slots if wide else 0)
    return {"to_nn_worker": e + 4 * (num_dense + 1), "to_embedding_worker": e}


def _ident(b: bytes) -> bytes:
    return b


def _index(meta: dict, key: str, bound: int) -> int:
    """``meta[key]`` as an integer in ``0 .. bound - 1``. Raises ``ValueError`` naming the field."""
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < bound:
        raise ValueError(f"{key}={v!r}: expected an integer in 0..{bound - 1}")
    return v


# ---- the NN worker's side ------------------------------------------------------------------------------------


class StreamBridge:
    """One embedding worker's stream, seen from its NN worker: relays between the NN worker's ring (``buf``,
    ``layout``, slot views of embedding worker ``e``), its end ``sock`` of the control socket pair, and the
    stream to ``address``. ``spec``: the first message's meta. ``on_frontier(e)``: called after the frontier of
    ``e`` advanced (to relay it to the other embedding workers)."""

    def __init__(
        self,
        address: str,
        token: str | None,
        layout: rr.RingLayout,
        buf: np.ndarray,
        e: int,
        sock: socket.socket,
        spec: dict,
        on_frontier,
        connect_timeout_s: float,
        keepalive_s: float = KEEPALIVE_S,
    ):
        self.address, self.layout, self.buf, self.e, self.sock = address, layout, buf, e, sock
        self.on_frontier = on_frontier
        self.frontier = layout.frontier(buf)
        self.phase = layout.phase_seconds(buf)
        self.rows = [0] * layout.slots_per_worker
        self.error = ""
        self.out: queue.Queue = queue.Queue()
        self.channel = grpc.insecure_channel(address, options=keepalive_options(keepalive_s, server=False))
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise ConnectionError(f"not reachable at {address} within {connect_timeout_s:.0f} s") from None
        metadata: tuple[tuple[str, str | bytes], ...] = ((TOKEN_HEADER, token),) if token else ()
        feed = self.channel.stream_stream(FEED, request_serializer=_ident, response_deserializer=_ident)
        self.out.put(wire.encode({"kind": "spec", **spec}))
        self.call = feed(iter(self.out.get, None), metadata=metadata)
        self.threads = [
            threading.Thread(target=self._receive, name=f"ready-stream-in-{e}", daemon=True),
            threading.Thread(target=self._send, name=f"ready-stream-out-{e}", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def relay_frontier(self) -> None:
        """Send the NN worker's current frontiers of all embedding workers to this one."""
        self.out.put(wire.encode({"kind": "frontier"}, {"frontier": self.frontier.copy()}))

    def _receive(self) -> None:
        e = self.e
        try:
            for data in self.call:
                meta, arrays = wire.decode(data)
                kind = meta.get("kind")
                if kind == "ready":
                    slot, rows = (
                        _index(meta, "slot", self.layout.slots_per_worker),
                        _index(meta, "rows", self.layout.batch + 1),
                    )
                    _, dense, labels = self.layout.slot(self.buf, e, slot)
                    self.layout.emb(self.buf, e, slot, self.layout.half)[:rows] = arrays["emb"]
                    dense[:rows] = arrays["dense"]
                    labels[:rows] = arrays["labels"]
                    wide = self.layout.wide_view(self.buf, e, slot)
                    if wide is not None:
                        wide[:rows] = arrays["wide"]
                    self.rows[slot] = rows
                    self._advance(int(meta["frontier"]), arrays["phase"])
                    rr.send(self.sock, rr.READY, slot, int(meta["step"]), rows, int(meta["staleness"]))
                elif kind == "frontier":
                    self._advance(int(meta["frontier"]), arrays["phase"])
                elif kind == "started":
                    rr.send(self.sock, rr.STARTED)
                elif kind == "error":
                    rr.send(self.sock, rr.ERROR, text=str(meta.get("text", "")))
                else:
                    raise ValueError(f"unknown message kind {kind!r}")
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            if code != grpc.StatusCode.CANCELLED:
                self.error = f"its stream from {self.address} failed: {code.name if code else ''} {err.details()}"
        except Exception as err:  # a bad message (or this side's socket gone): the stream is over
            self.error = f"its stream from {self.address} sent a bad message: {type(err).__name__}: {err}"
            self.call.cancel()
        finally:
            if not self.error and self.frontier[e] != rr.NEVER:
                self.error = f"its stream from {self.address} ended early"
            try:  # the NN worker's next wait sees it (PeerGone) and asks ``error`` why; ``_send`` wakes up
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _advance(self, frontier: int, phase: np.ndarray) -> None:
        self.phase[self.e] = phase
        if frontier > self.frontier[self.e]:
            self.frontier[self.e] = frontier
            self.on_frontier(self.e)

    def _send(self) -> None:
        try:
            while True:
                msg = rr.recv(self.sock, None)
                assert msg is not None
                kind, slot, step, half = msg[0], msg[1], msg[2], msg[3]
                if kind == rr.GRAD:
                    rows = self.rows[slot]
                    arrays = {"grad": self.layout.emb(self.buf, self.e, slot, bool(half))[:rows]}
                    wide = self.layout.wide_view(self.buf, self.e, slot)
                    if wide is not None:
                        arrays["wide"] = wide[:rows]
                    self.out.put(wire.encode({"kind": "grad", "slot": slot, "step": step}, arrays))
                elif kind == rr.STOP:
                    self.out.put(wire.encode({"kind": "stop"}))
                    break
        except (rr.PeerGone, OSError, ValueError):
            pass
        finally:
            self.out.put(None)  # ends the request stream

    def close(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic``) for the stream to end (after the ``STOP`` the NN worker
        sent), else cancel it; close the channel."""
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self.threads):
            self.call.cancel()
            for t in self.threads:
                t.join(timeout=2.0)
        self.channel.close()


# ---- the embedding worker's side -----------------------------------------------------------------------------


MAX_RING_BYTES = 1 << 36
"""Largest ready ring a spec may ask for (64 GiB): anything past it is a bad spec, not an allocation to try."""


def _first_message(request_iterator, context, timeout_s: float) -> bytes | None:
    """The stream's first message, or None when it ended first; aborts the call (DEADLINE_EXCEEDED) when none
    arrives within ``timeout_s``."""
    got: list = []
    done = threading.Event()

    def read() -> None:
        try:
            got.append(next(request_iterator, None))
        except Exception:  # the call ended (cancelled by the peer, or aborted below)
            got.append(None)
        done.set()

    threading.Thread(target=read, name="ready-stream-spec", daemon=True).start()
    if not done.wait(timeout_s):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no spec within {timeout_s:.0f} s")
    return got[0]


def _check_spec(meta: dict) -> rr.RingLayout:
    """The ring layout a spec asks for, checked. Raises ``ValueError`` naming the bad field."""
    values = meta.get("layout")
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"layout={values!r}: expected 7 integers")
    layout = rr.RingLayout.from_list(values)
    if min(layout.workers, layout.slots_per_worker, layout.batch, layout.num_slots, layout.dim) < 1:
        raise ValueError(f"layout={values!r}: workers, slots, batch, slots per example and dim must be >= 1")
    if layout.num_dense < 0 or layout.ring_bytes > MAX_RING_BYTES:
        raise ValueError(f"layout={values!r}: {layout.ring_bytes} bytes (at most {MAX_RING_BYTES})")
    _index(meta, "index", layout.workers)
    frontier = meta.get("frontier")
    if (
        not isinstance(frontier, list)
        or len(frontier) != layout.workers
        or not all(isinstance(f, int) and not isinstance(f, bool) for f in frontier)
    ):
        raise ValueError(f"frontier={frontier!r}: expected {layout.workers} integers")
    return layout


class _Session:
    """One NN worker's stream, seen from its embedding worker: the worker runs in a thread of this process
    against a ring of its own; ``responses`` yields what it hands over. Raises ``ValueError`` for a bad first
    message (nothing is then allocated); a set-up failure (``build``) is reported on the stream instead."""

    def __init__(self, build, request_iterator, context, spec_timeout_s: float):
        first = _first_message(request_iterator, context, spec_timeout_s)
        if first is None:
            raise ValueError("the stream ended before its spec")
        meta, _ = wire.decode(first)
        if meta.pop("kind", None) != "spec":
            raise ValueError("the first message of a stream must be its spec")
        self.layout = _check_spec(meta)
        self.spec = meta
        self.index = int(meta["index"])
        self.segment = rr.Segment(self.layout, shared=False)
        self.buf = self.segment.buf
        self.frontier = self.layout.frontier(self.buf)
        self.frontier[:] = np.asarray(meta["frontier"], dtype=np.int64)
        self.others = np.arange(self.layout.workers) != self.index
        self.phase = self.layout.phase_seconds(self.buf)[self.index]
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.out: queue.Queue = queue.Queue()
        self.stopped = False
        self.requests = request_iterator
        self.worker: Any = None
        self.threads: list[threading.Thread] = []
        self.build_error: BaseException | None = None
        try:
            self.worker = build(meta, self.buf, theirs, self._notify)
        except Exception as e:  # reported to the NN worker; the process then exits 1
            self.build_error = e
            log.error("set-up failed: %s: %s", type(e).__name__, e)
            self.out.put(wire.encode({"kind": "error", "text": f"set-up failed: {type(e).__name__}: {e}"}))
            self.out.put(None)
            theirs.close()
            return
        self.theirs = theirs
        self.threads = [
            threading.Thread(target=self._run_worker, name="embedding-worker", daemon=True),
            threading.Thread(target=self._from_worker, name="ready-stream-out", daemon=True),
            threading.Thread(target=self._from_nn_worker, name="ready-stream-in", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _notify(self) -> None:
        self.out.put("frontier")

    def _frontier_msg(self) -> bytes:
        f = int(self.frontier[self.index])
        return wire.encode({"kind": "frontier", "frontier": f}, {"phase": self.phase.copy()})

    def _run_worker(self) -> None:
        try:
            self.worker.run()
        except BaseException as e:  # already sent to the NN worker as ERROR
            log.error("embedding worker failed: %s: %s", type(e).__name__, e)
        finally:
            self.theirs.close()

    def _from_worker(self) -> None:
        try:
            while True:
                msg = rr.recv(self.ours, None)
                assert msg is not None
                kind, slot, step, a, b, text = msg
                if kind == rr.READY:
                    _, dense, labels = self.layout.slot(self.buf, self.index, slot)
                    emb = self.layout.emb(self.buf, self.index, slot, self.layout.half)
                    meta = {"kind": "ready", "slot": slot, "step": step, "rows": a, "staleness": b}
                    meta["frontier"] = int(self.frontier[self.index])
                    arrays = {"emb": emb[:a], "dense": dense[:a], "labels": labels[:a], "phase": self.phase.copy()}
                    wide = self.layout.wide_view(self.buf, self.index, slot)
                    if wide is not None:
                        arrays["wide"] = wide[:a]
                    self.out.put(wire.encode(meta, arrays))
                elif kind == rr.STARTED:
                    self.out.put(wire.encode({"kind": "started"}))
                elif kind == rr.ERROR:
                    self.out.put(wire.encode({"kind": "error", "text": text}))
        except (rr.PeerGone, OSError):
            pass
        finally:
            self.out.put(self._frontier_msg())
            self.out.put(None)

    def _from_nn_worker(self) -> None:
        """Requests -> the worker's control socket; whatever ends them (``stop``, the NN worker gone, a bad
        message) stops the worker."""
        why = "its NN worker went away without a stop"
        try:
            for data in self.requests:
                meta, arrays = wire.decode(data)
                kind = meta.get("kind")
                if kind == "grad":
                    slot = _index(meta, "slot", self.layout.slots_per_worker)
                    step = _index(meta, "step", rr.NEVER)
                    grad = arrays["grad"]
                    half = grad.dtype == np.float16
                    dst = self.layout.emb(self.buf, self.index, slot, half)
                    if grad.ndim != 3 or grad.shape[1:] != dst.shape[1:] or len(grad) > len(dst):
                        raise ValueError(f"grad of shape {grad.shape}: the ring's slots are {dst.shape}")
                    dst[: len(grad)] = grad
                    wide = self.layout.wide_view(self.buf, self.index, slot)
                    if wide is not None:
                        got = arrays.get("wide")
                        if got is None or got.shape != (len(grad), *wide.shape[1:]):
                            shape = None if got is None else got.shape
                            raise ValueError(f"wide grad of shape {shape}: the ring's slots are {wide.shape}")
                        wide[: len(grad)] = got
                    rr.send(self.ours, rr.GRAD, slot, step, int(half))
                elif kind == "frontier":
                    relayed = arrays["frontier"]
                    if relayed.shape != self.frontier.shape:
                        raise ValueError(f"frontier of shape {relayed.shape}, expected {self.frontier.shape}")
                    o = self.others  # never this worker's own entry: only it writes that one
                    self.frontier[o] = np.maximum(self.frontier[o], relayed[o])
                elif kind == "stop":
                    self.stopped = True
                    why = ""
                    return
                else:
                    raise ValueError(f"unknown message kind {kind!r}")
        except grpc.RpcError:
            pass
        except Exception as e:  # a bad message: this stream is over
            why = f"a bad message from its NN worker: {type(e).__name__}: {e}"
        finally:
            if why:
                log.error("stopping: %s", why)
            try:
                rr.send(self.ours, rr.STOP)
            except OSError:
                pass

    def responses(self):
        while True:
            item = self.out.get()
            if item is None:
                return
            yield self._frontier_msg() if item == "frontier" else item

    def close(self) -> None:
        for t in self.threads:
            t.join(timeout=10)
        self.ours.close()
        self.segment.close()


class FeedServer:
    """A gRPC server for one embedding worker on ``host:port`` (0: any free port), serving one NN worker's
    stream at a time. ``build(spec, buf, sock, notify) -> EmbeddingWorker`` sets a worker up from a stream's spec.
    ``sessions``: streams served before ``wait`` returns. Raises ``RuntimeError`` when the port cannot be bound."""

    def __init__(
        self,
        build,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        sessions: int = 1,
        keepalive_s: float = KEEPALIVE_S,
        spec_timeout_s: float = SPEC_TIMEOUT_S,
    ):
        self.build, self.token = build, token
        self.left = sessions
        self.spec_timeout_s = spec_timeout_s
        self.busy = threading.Lock()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.clean = True
        options = [*keepalive_options(keepalive_s, server=True), ("grpc.so_reuseport", 0)]  # a port of its own
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
        handler = grpc.stream_stream_rpc_method_handler(
            self._feed, request_deserializer=_ident, response_serializer=_ident
        )
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Feed": handler}),))
        self.port = bind_port(self.server, host, port, "embedding worker")  # PortInUse naming the address
        self.server.start()

    def _feed(self, request_iterator, context):
        if self.token is not None:
            got = dict(context.invocation_metadata()).get(TOKEN_HEADER, "")
            if not hmac.compare_digest(str(got).encode(), self.token.encode()):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        if not self.busy.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this embedding worker already serves an NN worker")
        if self.done.is_set():
            self.busy.release()
            context.abort(grpc.StatusCode.UNAVAILABLE, "this embedding worker has served its NN worker and stops")
        try:
            session = _Session(self.build, request_iterator, context, self.spec_timeout_s)
        except (ValueError, KeyError, TypeError) as e:  # refused before it began: not one of the sessions
            self.busy.release()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad spec: {e}")
            return
        except BaseException:
            self.busy.release()
            raise
        try:
            yield from session.responses()
        finally:
            session.close()
            with self.lock:
                self.clean = self.clean and session.stopped and session.build_error is None
                self.left -= 1
                if self.left <= 0:
                    self.done.set()
            self.busy.release()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the sessions are served (True) or ``timeout_s`` passes (False)."""
        return self.done.wait(timeout_s)

    def stop(self) -> None:
        self.server.stop(grace=2).wait()
