"""The gRPC service of one parameter-server shard: the servicer, its token check, and ``serve``.

Service ``persia.ParameterServer`` (unary calls, ``persia_core.ps.wire`` messages):

    Lookup          meta {table}            ids uint64[U]           -> rows float32[U, D] (rows created)
    LookupReadonly  meta {table}            ids uint64[U]           -> rows float32[U, D] (unseen -> zeros)
    Push            meta {table, client, seq, step, sync_workers}  ids, grads float32[U, D] -> {applied, dropped}
    Dump            meta {path}                       -> {bytes, crc32c}  (shard file: rows, optimizer state,
                                                         recency list, applied-push records; see embedding.shard_file)
    Load            meta {path, size?, crc32c?}       -> {ok}   (refused unless size and CRC-32C match, if given)
    Contains, Stats, Health

What each call does to the shard is ``persia_core.ps.shard.ParameterServerShard``'s. Errors map to status codes:
a bad request INVALID_ARGUMENT, a path outside the storage roots PERMISSION_DENIED, a sync step not completed in
time DEADLINE_EXCEEDED, an unusable shared-memory segment FAILED_PRECONDITION, anything else INTERNAL (an error
answer, never a hang).

Same-host transport: a client on this host may pass the arrays of a call in a shared-memory segment instead of
the message (``persia_core.ps.shm``), and make the call over the server's local channel instead of gRPC
(``persia_core.ps.local_channel``, named in ``Health``'s answer); the handlers, token check and answers are the
same.

Security: with a token, every call must carry it in the ``x-persia-token`` metadata, else it is refused with
UNAUTHENTICATED. ``Dump`` and ``Load`` reach only paths under the storage roots (``check_storage_path``); with
none, any path the process can write and read.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import socket
from concurrent import futures

import grpc
import numpy as np

from persia_core.ps import shm as shm_mod
from persia_core.ps import wire
from persia_core.ps.local_channel import LocalListener, supported
from persia_core.ps.protocol import GRPC_OPTIONS, SERVICE, TOKEN_HEADER
from persia_core.ps.shard import ParameterServerShard, check_ids
from persia_core.ps.storage_roots import check_storage_path, resolve_storage_roots

log = logging.getLogger("persia.ps")


class _Servicer:
    def __init__(self, shard: ParameterServerShard, token: str | None, storage_roots: list[str] | None = None):
        self.shard = shard
        self.token = token
        self.storage_roots = resolve_storage_roots(storage_roots)
        self.segments = shm_mod.SegmentCache()
        self.local: LocalListener | None = None

    def _check(self, context) -> None:
        if self.token is None:
            return
        got = dict(context.invocation_metadata()).get(TOKEN_HEADER, "")
        if not hmac.compare_digest(got.encode(), self.token.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong parameter-server token")

    def _wrap(self, fn):
        def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
            return self._answer(fn, request, context)

        return grpc.unary_unary_rpc_method_handler(handler)

    def _answer(self, fn, request, context) -> bytes:
        """One call of handler ``fn`` on ``request`` (a message's bytes), over gRPC or the local channel (its
        ``context`` answers ``abort`` and ``time_remaining`` alike)."""
        self._check(context)
        try:
            meta, arrays = wire.decode(request)
            shm = meta.pop("shm", None)
            buf = None
            if shm is not None:  # the arrays are in the client's shared-memory segment (persia_core.ps.shm)
                buf = self.segments.get(shm.get("name"), shm.get("size", 0))
                arrays = shm_mod.views(buf, shm.get("arrays", []))
            out_area = shm.get("out", [0, 0]) if shm is not None else [0, 0]

            def reply_to(shape, dtype):  # where a reply array may be written in place (shared memory only)
                return None if buf is None else shm_mod.reply_array(buf, out_area, shape, dtype)

            out_meta, out_arrays = fn(meta, arrays, context, reply_to)
            if buf is not None and out_arrays:
                entries = shm_mod.write_reply(buf, out_area, out_arrays)
                if entries is not None:
                    return wire.encode({**out_meta, "shm_out": entries})
            return wire.encode(out_meta, out_arrays)
        except shm_mod.ShmUnavailable as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.shard.shard}: {e}")
        except PermissionError as e:
            if e.errno is not None:  # the operating system refused (not the storage-root check): log it
                log.exception("request refused by the operating system")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"shard {self.shard.shard}: {e}")
        except (ValueError, KeyError, TypeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"shard {self.shard.shard}: {e}")
        except TimeoutError as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except Exception as e:  # an error answer, never a hang
            log.exception("request failed")
            context.abort(grpc.StatusCode.INTERNAL, f"shard {self.shard.shard}: {type(e).__name__}: {e}")
        raise AssertionError("context.abort returned")  # it raises, on both transports

    def methods(self) -> dict:
        """Method name -> handler ``fn(meta, arrays, context, reply_to) -> (meta, arrays)``; ``reply_to(shape,
        dtype)`` gives an array where the first reply array can be written in place (``shm.reply_array``), or
        None."""
        s = self.shard

        def lookup(meta, arrays, ctx, reply_to):
            ids = check_ids(arrays["ids"])
            out = reply_to((len(ids), s.table(meta["table"]).dim), np.float32)
            return {}, {"rows": s.lookup(meta["table"], ids, out)}

        def lookup_readonly(meta, arrays, ctx, reply_to):
            ids = check_ids(arrays["ids"])
            table = s.table(meta["table"])
            return {}, {"rows": table.lookup_readonly(ids, reply_to((len(ids), table.dim), np.float32))}

        def push(meta, arrays, ctx, reply_to):
            remaining = ctx.time_remaining()
            return s.push(meta, arrays["ids"], arrays["grads"], remaining), {}

        def contains(meta, arrays, ctx, reply_to):
            return {}, {"found": s.table(meta["table"]).contains(check_ids(arrays["ids"])).astype(np.uint8)}

        def dump(meta, arrays, ctx, reply_to):
            nbytes, crc = s.dump(check_storage_path(meta.get("path"), self.storage_roots))
            return {"bytes": nbytes, "crc32c": crc}, {}

        def load(meta, arrays, ctx, reply_to):
            s.load(check_storage_path(meta.get("path"), self.storage_roots), meta.get("size"), meta.get("crc32c"))
            return {"ok": True}, {}

        def stats(meta, arrays, ctx, reply_to):
            return s.stats(), {}

        def health(meta, arrays, ctx, reply_to):
            local = {"local": self.local.name} if self.local is not None else {}
            return {"ok": True, "shard": s.shard, "pid": os.getpid(), **local}, {}

        return {
            "Lookup": lookup,
            "LookupReadonly": lookup_readonly,
            "Push": push,
            "Contains": contains,
            "Dump": dump,
            "Load": load,
            "Stats": stats,
            "Health": health,
        }

    def handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {k: self._wrap(v) for k, v in self.methods().items()})

    def serve_local(self) -> LocalListener:
        """Start answering the same calls on a local channel (``persia_core.ps.local_channel``) as well; ``Health``
        then names its socket."""
        methods = self.methods()
        self.local = LocalListener(lambda name, request, ctx: self._answer(methods[name], request, ctx), self.token)
        return self.local


def serve(
    shard: ParameterServerShard,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    max_workers: int = 32,
    storage_roots: list[str] | None = None,
    local: bool = True,
) -> tuple[Server, int]:
    """Start a gRPC server for ``shard`` on ``host:port`` (0 = any free port). Returns (server, bound port).
    ``storage_roots``: where ``Dump`` and ``Load`` may write and read (``check_storage_path``; None: anywhere).
    ``local``: also answer clients on this host over a local channel (``persia_core.ps.local_channel``; Linux).

    The port is bound exclusively (no ``SO_REUSEPORT``, which gRPC sets by default on Linux: a second server on
    the same port would also serve, and the kernel would split the connections between the two).

    Raises ``PortInUse`` if the port cannot be bound, ``TypeError``/``ValueError`` for bad storage roots
    (``resolve_storage_roots``)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)]
    )
    servicer = _Servicer(shard, token, storage_roots)
    server.add_generic_rpc_handlers((servicer.handlers(),))
    bound = bind_port(server, host, port, "parameter server")
    server.start()
    return Server(server, servicer.serve_local() if local and supported() else None), bound


class Server:
    """A running parameter server: its gRPC server and its local channel's listener (or None)."""

    def __init__(self, grpc_server: grpc.Server, local: LocalListener | None):
        self.grpc_server, self.local = grpc_server, local

    def stop(self, grace: float | None):
        """Stop both; returns gRPC's ``threading.Event``, set once its calls have ended (``grpc.Server.stop``)."""
        if self.local is not None:
            self.local.stop()
        return self.grpc_server.stop(grace)


class PortInUse(RuntimeError):
    """A server's ``host:port`` cannot be bound (another process listens there, or the address is not this
    host's)."""


def bind_port(server: grpc.Server, host: str, port: int, what: str) -> int:
    """Bind ``server`` to ``host:port`` (0: a free port); returns the bound port. Raises ``PortInUse`` naming
    ``what`` and the address. A given port is first bound by a plain socket (``SO_REUSEADDR`` only, so a port
    left in TIME_WAIT stays usable), which fails where any socket listens: the refusal is then one line, without
    gRPC's own log line of the failed bind."""
    if not 0 <= port <= 65535:
        raise PortInUse(f"{what} could not bind {host}:{port}: a port is 0 (any free one) to 65535")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # a bare IPv6 address, as gRPC's address syntax needs it
    reason = _bind_error(host, port) if port else None
    if reason is None:
        try:
            bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # gRPC reports a failed bind as 0 or as RuntimeError, by version
            bound = 0
        if bound:
            return bound
        reason = "cannot be bound"
    raise PortInUse(f"{what} could not bind {host}:{port}: {reason}; choose another port, or stop that process")


def _bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound (in use, not this host's address), or None when a socket can bind every
    address the host resolves to (gRPC binds them all: ``localhost`` is 127.0.0.1 and ::1)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"the host does not resolve ({e})"
    probes = [(i[0], i[4], True) for i in infos]
    if host.lower() == "localhost":  # gRPC's own resolver gives both loopbacks, whatever /etc/hosts says
        probes += [(socket.AF_INET, ("127.0.0.1", port), False), (socket.AF_INET6, ("::1", port, 0, 0), False)]
    for family, addr, resolved in probes:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as gRPC binds each address on its own
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return f"the port is in use on {addr[0]}"
                if resolved:  # an extra loopback that this host lacks (no IPv6) is not an error
                    return f"{e.strerror} (is the address one of this host's?)"
    return None
