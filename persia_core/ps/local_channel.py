"""Same-host calls to a parameter server over a Unix socket, beside its gRPC port.

A Python gRPC unary call costs about a millisecond of CPU between its two ends, whatever it carries: several
thread hand-offs on each side. An embedding worker makes a lookup and a push per shard and table every batch, so
on one host that overhead is a large share of the sparse path's CPU. Here a server also listens on an abstract
Unix socket (Linux; no file is left behind), and a client on the same host sends the same ``wire`` messages as
length-prefixed frames over a connection it holds: one send and one receive per call, served by a thread of the
server's per connection. The arrays themselves still go through shared memory (``persia_core.ps.shm``); the
handlers, sequence numbers, deadlines, errors and the token are the gRPC service's
(``persia_core.ps.servicer``).

Frames:

    request  = uint64 payload bytes | uint16 method index (``METHODS``) | float64 deadline (seconds) | payload
    reply    = uint64 payload bytes | uint8 status (a ``grpc.StatusCode`` index; 0 = OK) | payload
    hello    = a request of method ``Hello`` whose payload is the token (UTF-8), the first frame of a connection

A connection whose hello carries the wrong token gets UNAUTHENTICATED and is closed. The socket's name is random
(128 bits) and given only in the token-checked ``Health`` answer, so a client learns it over gRPC first
(``EmbeddingClient``); a server or client in another network namespace cannot reach it and the client stays on
gRPC. Nothing here is ever unpickled.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable

import grpc

from persia_core.ps.protocol import MAX_MESSAGE_BYTES, TOKEN_HEADER

log = logging.getLogger("persia.ps.local")

METHODS = ("Hello", "Lookup", "LookupReadonly", "Push", "Contains", "Dump", "Load", "Stats", "Health")
"""Method of each index of a request frame."""
_REQ = struct.Struct("<QHd")
_REP = struct.Struct("<QB")
_CODES = list(grpc.StatusCode)
HELLO_TIMEOUT_S = 10.0
"""Seconds a new connection has to send its hello."""


def _code(status: int) -> grpc.StatusCode:
    return _CODES[status] if 0 < status < len(_CODES) else grpc.StatusCode.UNKNOWN


def supported() -> bool:
    """Whether this platform has abstract Unix sockets (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


class LocalRpcError(grpc.RpcError):
    """A failed call over the local channel, shaped as gRPC's errors are (``code()``, ``details()``), so that the
    client's retries and messages treat both transports alike."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class LocalContext:
    """The parts of ``grpc.ServicerContext`` the parameter-server handlers use, for a call on a local connection."""

    def __init__(self, token: str, deadline: float):
        self._metadata = ((TOKEN_HEADER, token),)
        self._deadline = deadline

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Abort(code, details)


def _send(sock: socket.socket, head: bytes, payload: bytes | bytearray) -> None:
    """One frame: a small one in one write, a large one without joining it to its header (no copy)."""
    if len(payload) < 65536:
        sock.sendall(head + payload)
    else:
        sock.sendall(head)
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return buf


class LocalListener:
    """Serves ``handle(method, request, context) -> reply bytes`` (``request``: the message's bytes) on an abstract
    Unix socket, one thread per connection; ``handle`` raises out of ``context.abort`` for an error answer.
    ``token``: the hello's expected token (None: any). ``name``: the socket's abstract name (without the leading
    NUL). ``stop()`` closes the socket and every connection."""

    def __init__(self, handle: Callable[[str, bytearray, LocalContext], bytes], token: str | None):
        self.handle, self.token = handle, token
        self.name = f"persia-ps-{os.getpid():x}-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.name)
        self.sock.listen(64)
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.stopped = False
        threading.Thread(target=self._accept, name="ps-local-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed by stop()
            with self.lock:
                if self.stopped:
                    conn.close()
                    return
                self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="ps-local-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            token = self._hello(conn)
            if token is None:
                return
            while True:
                n, method, timeout_s = _REQ.unpack(_recv_exact(conn, _REQ.size))
                if n > MAX_MESSAGE_BYTES or method >= len(METHODS):
                    return  # not a client of ours: drop the connection
                request = _recv_exact(conn, n)
                ctx = LocalContext(token, time.monotonic() + timeout_s)
                try:
                    reply, status = self.handle(METHODS[method], request, ctx), 0
                except _Abort as e:
                    reply, status = e.details.encode("utf-8", "replace"), _CODES.index(e.code)
                _send(conn, _REP.pack(len(reply), status), reply)
        except (OSError, ConnectionError, struct.error):
            return  # the client went away
        finally:
            with self.lock:
                self.conns.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket) -> str | None:
        conn.settimeout(HELLO_TIMEOUT_S)  # a connection that says nothing does not hold its thread
        n, method, _ = _REQ.unpack(_recv_exact(conn, _REQ.size))
        if method != 0 or n > 4096:
            return None
        got = bytes(_recv_exact(conn, n)).decode("utf-8", "replace")
        conn.settimeout(None)
        if self.token is not None and not hmac.compare_digest(got.encode(), self.token.encode()):
            msg = b"missing or wrong parameter-server token"
            conn.sendall(_REP.pack(len(msg), _CODES.index(grpc.StatusCode.UNAUTHENTICATED)) + msg)
            return None
        conn.sendall(_REP.pack(0, 0))
        return got

    def stop(self) -> None:
        """Stop listening and close every connection (calls in flight end with an error on the client)."""
        with self.lock:
            self.stopped = True
            conns, self.conns = list(self.conns), set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class LocalChannel:
    """A client's connections to one server's ``LocalListener`` (abstract name ``name``), made on demand, one per
    concurrent call. ``connect_timeout_s``: for making a connection and its hello.

    Raises ``OSError`` from the constructor when the socket cannot be reached (another host or network
    namespace), ``LocalRpcError`` from ``call``."""

    def __init__(self, name: str, token: str | None, connect_timeout_s: float = 5.0):
        self.name, self.token = name, token or ""
        self.connect_timeout_s = connect_timeout_s
        self.idle: list[socket.socket] = []
        self.busy: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.closed = False
        self.idle.append(self._connect())  # reachable, and the token's answer known, before the first call

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(self.connect_timeout_s)
            s.connect("\0" + self.name)
            token = self.token.encode()
            s.sendall(_REQ.pack(len(token), 0, 0.0) + token)
            n, status = _REP.unpack(_recv_exact(s, _REP.size))
            if status:
                raise LocalRpcError(_code(status), bytes(_recv_exact(s, n)).decode("utf-8", "replace"))
            return s
        except BaseException:
            s.close()
            raise

    def call(self, method: str, request: bytes, timeout_s: float) -> bytearray:
        """One call: the reply's bytes. Raises ``LocalRpcError``: the server's error status, DEADLINE_EXCEEDED
        after ``timeout_s``, UNAVAILABLE when the connection broke (the server died), CANCELLED after ``close``."""
        with self.lock:
            if self.closed:
                raise LocalRpcError(grpc.StatusCode.CANCELLED, "the client was closed")
            s = self.idle.pop() if self.idle else None
        try:
            if s is None:
                s = self._connect()
            with self.lock:
                self.busy.add(s)
        except LocalRpcError:
            raise
        except OSError as e:
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"local connection failed: {e}") from None
        ok = False
        try:
            s.settimeout(max(timeout_s, 0.001))
            _send(s, _REQ.pack(len(request), METHODS.index(method), timeout_s), request)
            n, status = _REP.unpack(_recv_exact(s, _REP.size))
            payload = _recv_exact(s, n)
            ok = True
        except TimeoutError:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (OSError, ConnectionError) as e:
            code = grpc.StatusCode.CANCELLED if self.closed else grpc.StatusCode.UNAVAILABLE
            raise LocalRpcError(code, f"local connection lost: {e}") from None
        finally:
            with self.lock:
                self.busy.discard(s)
                if ok and not self.closed:
                    self.idle.append(s)  # a connection that failed may still get the late reply: never reused
                else:
                    s.close()
        if status:
            raise LocalRpcError(_code(status), bytes(payload).decode("utf-8", "replace"))
        return payload

    def close(self) -> None:
        """Close every connection; calls in flight end at once with CANCELLED."""
        with self.lock:
            self.closed = True
            socks, self.idle = [*self.idle, *self.busy], []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if s not in self.busy:
                s.close()
