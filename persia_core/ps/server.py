"""Embedding parameter server: one process per shard, serving its ``EmbeddingTable``s over gRPC.

Service ``persia.ParameterServer`` (unary calls, ``persia_core.ps.wire`` messages):

    Lookup          meta {table}            ids uint64[U]           -> rows float32[U, D] (rows created)
    LookupReadonly  meta {table}            ids uint64[U]           -> rows float32[U, D] (unseen -> zeros)
    Push            meta {table, client, seq, step, sync_workers}  ids, grads float32[U, D] -> {applied, dropped}
    Dump            meta {path}                       -> {bytes, crc32c}  (shard file: rows, optimizer state,
                                                         recency list, applied-push records; see embedding.sharded)
    Load            meta {path, size?, crc32c?}       -> {ok}   (refused unless size and CRC-32C match, if given)
    Stats, Health

Push semantics (PERSIA, Lian et al., KDD 2022, Sec. 4.2):
- ``sync_workers <= 1``: applied on arrival, in arrival order (asynchronous embedding training).
- ``sync_workers = M > 1``: the pushes of ``step`` from M distinct clients are concatenated, gradients of the
  same ID summed, and applied once; each of the M calls returns only after that (fully synchronous, K = 0).
- Exactly once: a push carries a per-client sequence number; a retried push already applied is acknowledged
  without being applied again. The records of applied numbers are part of the shard's dump, so they survive a
  restart from a checkpoint (clients of a resumed run also take new ids: see ``persia_core.train.worker``).

Incremental export (``--delta-dir``, ``--delta-every-s``): the IDs created by lookups and updated by pushes are
recorded, and every T seconds their rows are written as a delta file (``persia_core.embedding.delta``).

Exit codes of ``main``: 0 stopped by SIGTERM/SIGINT; 3 the ``--init`` state was refused (missing, partial or
corrupt: the log's last line says which check failed); other non-zero: a crash.

Same-host transport: a client on this host may pass the arrays of a call in a shared-memory segment instead of
the message (``persia_core.ps.shm``); the call, token check and answers are the same.

Security: binds 127.0.0.1 unless ``--host`` says otherwise, and refuses to bind any other address without a
token; when ``PERSIA_PS_TOKEN`` is set every call must carry it in the ``x-persia-token`` metadata, else it is
refused with UNAUTHENTICATED. Requests are checked before anything is applied: ids must be ``uint64[U]``, a push's
gradients ``float32[U, D]`` and finite, its ``step_fraction`` in (0, 1]. ``Dump`` and ``Load`` reach only paths
under the server's storage roots (``--storage-root``, repeatable, or ``PERSIA_PS_STORAGE_ROOTS``, comma-separated;
the launchers pass the run's model and checkpoint folders): any other path is refused with PERMISSION_DENIED. A
server started without roots writes and reads any path it can (the token is then the only guard).
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np

from persia_core import io
from persia_core.argchecks import storage_root
from persia_core.config import RunConfig, load_config
from persia_core.embedding.shard_file import read_shard_file
from persia_core.embedding.shard_tables import (
    check_shard_contents,
    make_tables,
    restore_shard_contents,
    write_shard_file,
)
from persia_core.ps import shm as shm_mod
from persia_core.ps import wire
from persia_core.ps.protocol import EXIT_BAD_INIT, GRPC_OPTIONS, SERVICE, STORAGE_ROOTS_ENV, TOKEN_ENV, TOKEN_HEADER
from persia_core.ps.storage_roots import check_storage_path, resolve_storage_roots

log = logging.getLogger("persia.ps")


class _Applied:
    """Per-client record of applied sequence numbers: a watermark plus the set above it.

    A client numbers its pushes across all shards, so a shard sees gaps that never fill; the set is kept to
    ``MAX_ABOVE`` numbers by moving the watermark up past the oldest half (a push older than thousands of newer
    ones from the same client is taken as applied: with bounded staleness it cannot still be in flight)."""

    MAX_ABOVE = 4096

    def __init__(self, low: int = -1, above=()) -> None:
        self.low = int(low)
        self.above: set[int] = {int(a) for a in above}

    def seen(self, seq: int) -> bool:
        return seq <= self.low or seq in self.above

    def add(self, seq: int) -> None:
        self.above.add(seq)
        while self.low + 1 in self.above:
            self.low += 1
            self.above.discard(self.low)
        if len(self.above) > self.MAX_ABOVE:
            ordered = sorted(self.above)
            cut = ordered[len(ordered) // 2]
            self.low = cut
            self.above = {a for a in ordered if a > cut}

    def to_json(self) -> list:
        return [self.low, sorted(self.above)]


def check_push_arrays(table, ids: np.ndarray, grads: np.ndarray, finite: bool) -> None:
    """Refuse a push whose arrays do not fit ``table`` before anything is applied or buffered: ``ids`` must be
    ``uint64[U]``, ``grads`` ``float32[U, D]`` (D the table's dim), all finite when ``finite``. Raises
    ``ValueError`` naming what is wrong."""
    check_ids(ids, "push: ")
    if grads.dtype != np.float32 or grads.shape != (len(ids), table.dim):
        raise ValueError(f"push: grads must be float32[{len(ids)}, {table.dim}], got {grads.dtype}{list(grads.shape)}")
    if finite and not np.isfinite(grads).all():
        raise ValueError("push: gradients contain NaN or inf; nothing was applied")


def check_ids(ids: np.ndarray, what: str = "") -> np.ndarray:
    """``ids`` as sent: ``uint64[U]``, else ``ValueError`` (prefixed ``what``; no silent conversion of other
    dtypes)."""
    if ids.dtype != np.uint64 or ids.ndim != 1:
        raise ValueError(f"{what}ids must be uint64[U], got {ids.dtype}{list(ids.shape)}")
    return ids


class ParameterServerShard:
    """The tables of one shard plus push bookkeeping; the gRPC servicer calls into this (no gRPC here).

    Args:
        config: the run config (its ``embedding`` section defines the tables).
        shard: this shard's index; num_shards: shards in the plan.
        capacities: rows per table (from the shard plan); default: from ``embedding.shard_memory_bytes``.
    """

    def __init__(self, config: RunConfig, shard: int, num_shards: int, capacities: dict[str, int] | None = None):
        self.shard = shard
        self.num_shards = num_shards
        self.tables = make_tables(
            config.embedding.tables,
            config.embedding.shard_memory_bytes,
            seed=config.trainer.seed,
            capacities=capacities,
            storage=config.embedding.storage,
        )
        self.cond = threading.Condition()
        self.applied: dict[str, _Applied] = {}
        self.pending: dict[tuple[str, int], dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        self.done_steps: dict[str, int] = {}
        self.pushes = 0
        self.duplicates = 0
        self.table_cpu_s = 0.0  # CPU seconds spent in table lookups and gradient applies
        self.delta_seq = 0
        self.tracker = None  # a DeltaTracker while incremental export is on
        self.exporter = None

    def table(self, name: str):
        try:
            return self.tables[name]
        except KeyError:
            raise ValueError(f"shard {self.shard}: no table {name!r} (have {sorted(self.tables)})") from None

    def lookup(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` in table ``name``, created where unseen (recorded for the incremental export)."""
        t0 = time.thread_time()
        rows = self.table(name).lookup(ids)
        self.table_cpu_s += time.thread_time() - t0
        if self.tracker is not None:
            self.tracker.record(name, ids)
        return rows

    def start_deltas(self, delta_dir: str, every_s: float) -> None:
        """Record changed rows and write them as delta files every ``every_s`` seconds (0: only on
        ``export_delta``). See ``persia_core.embedding.delta``."""
        from persia_core.embedding.delta import DeltaExporter, DeltaTracker

        self.tracker = DeltaTracker(self.tables)
        self.exporter = DeltaExporter(
            self.tables, self.tracker, delta_dir, self.shard, every_s, self.delta_seq, lock=self.cond
        )
        self.exporter.start()

    def export_delta(self) -> str | None:
        """Write the rows changed since the last delta now. Returns the file, or None when nothing changed."""
        if self.exporter is None:
            raise ValueError(f"shard {self.shard}: incremental export is off (no delta folder)")
        path = self.exporter.export()
        self.delta_seq = self.exporter.seq
        return path

    def push(self, meta: dict, ids: np.ndarray, grads: np.ndarray, timeout: float | None) -> dict:
        """Apply (or buffer, in sync mode) one gradient push; see the module docstring. Raises
        ``TimeoutError`` when a sync step is not completed by the other workers within ``timeout`` seconds."""
        table = self.table(meta["table"])
        client, seq = meta["client"], meta["seq"]
        step, m = meta.get("step", 0), meta.get("sync_workers", 0)
        fraction = meta.get("step_fraction", 1.0)
        if not isinstance(client, str) or not client:
            raise ValueError(f"push: client must be a non-empty string, got {client!r}")
        for name, v in (("seq", seq), ("step", step), ("sync_workers", m)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"push: {name} must be an integer >= 0, got {v!r}")
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"push: step_fraction must be in (0, 1], got {fraction!r}")
        check_push_arrays(table, ids, grads, finite=m > 1)  # async: apply_gradients checks finiteness itself
        with self.cond:
            rec = self.applied.setdefault(client, _Applied())
            if m <= 1:
                if rec.seen(seq):
                    self.duplicates += 1
                    return {"applied": False, "duplicate": True, "dropped": 0}
                t0 = time.thread_time()
                dropped = table.apply_gradients(ids, grads, float(fraction))
                self.table_cpu_s += time.thread_time() - t0
                rec.add(seq)
                self.pushes += 1
                if self.tracker is not None:
                    self.tracker.record(meta["table"], ids)
                return {"applied": True, "duplicate": False, "dropped": dropped}
            key = (meta["table"], step)
            if not rec.seen(seq):
                if client in self.pending.get(key, {}):
                    raise ValueError(
                        f"push: client {client!r} already pushed step {step} of table "
                        f"{meta['table']!r} (sequence numbers differ: not a retry)"
                    )
                self.pending.setdefault(key, {})[client] = (ids.copy(), grads.copy())
                rec.add(seq)
            else:
                self.duplicates += 1
            bucket = self.pending.get(key)
            if bucket is not None and len(bucket) >= m:
                all_ids = np.concatenate([b[0] for b in bucket.values()])
                all_grads = np.concatenate([b[1] for b in bucket.values()])
                t0 = time.thread_time()
                dropped = table.apply_gradients(all_ids, all_grads)
                self.table_cpu_s += time.thread_time() - t0
                if self.tracker is not None:
                    self.tracker.record(meta["table"], all_ids)
                del self.pending[key]
                self.done_steps[meta["table"]] = max(self.done_steps.get(meta["table"], -1), step)
                self.pushes += 1
                self.cond.notify_all()
                return {"applied": True, "duplicate": False, "dropped": dropped}
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.done_steps.get(meta["table"], -1) < step:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"shard {self.shard}: sync step {step} of table {meta['table']!r} got "
                        f"{len(self.pending.get(key, {}))} of {m} workers' pushes in time"
                    )
                self.cond.wait(remaining)
            return {"applied": True, "duplicate": False, "dropped": 0}

    def stats(self) -> dict:
        with self.cond:
            return {
                "shard": self.shard,
                "num_shards": self.num_shards,
                "pushes": self.pushes,
                "duplicate_pushes": self.duplicates,
                "table_cpu_s": round(self.table_cpu_s, 6),
                "process_cpu_s": round(time.process_time(), 6),
                "tables": {n: t.stats() for n, t in self.tables.items()},
            }

    def server_state(self) -> dict:
        """The bookkeeping that goes into a dump: applied-push records per client, last combined step per table
        (K = 0), counters, and the number of the last delta exported."""
        return {
            "shard": self.shard,
            "num_shards": self.num_shards,
            "applied": {c: r.to_json() for c, r in self.applied.items()},
            "done_steps": dict(self.done_steps),
            "pushes": self.pushes,
            "duplicates": self.duplicates,
            "delta_seq": self.exporter.seq if self.exporter is not None else self.delta_seq,
        }

    def restore_server_state(self, state: dict) -> None:
        """Take back ``server_state()`` from a dump of the same shard (a state re-sharded from other shards has
        none)."""
        if not state or state.get("shard") != self.shard or state.get("num_shards") != self.num_shards:
            return
        self.applied = {c: _Applied(low, above) for c, (low, above) in state.get("applied", {}).items()}
        self.done_steps = {k: int(v) for k, v in state.get("done_steps", {}).items()}
        self.pushes = int(state.get("pushes", 0))
        self.duplicates = int(state.get("duplicates", 0))
        self.delta_seq = int(state.get("delta_seq", 0))

    def dump(self, path: str) -> tuple[int, int]:
        """Write this shard's rows, optimizer state, recency list and bookkeeping to ``path`` (local or gs://),
        with no push applied meanwhile. Returns ``(bytes written, CRC-32C)``."""
        with self.cond:
            return write_shard_file(path, self.tables, self.server_state())

    def load(self, path: str, expect_size: int | None = None, expect_crc32c: int | None = None) -> None:
        """Replace this shard's state with a shard file's. The file is read and checked before the shard's lock
        is taken, so calls keep being served meanwhile, and nothing is replaced unless every table in it fits.
        Raises ``ShardFileError`` when the file is partial, corrupt (size or CRC-32C differ from the expected
        ones) or does not fit the run config, ``ValueError`` when a local path is not a regular file (a device,
        a pipe or a folder), ``FileNotFoundError`` when it is missing."""
        if "://" not in path:
            import stat

            mode = os.stat(path).st_mode  # FileNotFoundError when missing
            if not stat.S_ISREG(mode):
                raise ValueError(f"load: {path} is not a regular file")
        contents = read_shard_file(path, expect_size, expect_crc32c)
        check_shard_contents(contents, self.tables, path)
        with self.cond:
            restore_shard_contents(contents, self.tables, path)
            self.restore_server_state(contents.server)


class _Servicer:
    def __init__(self, shard: ParameterServerShard, token: str | None, storage_roots: list[str] | None = None):
        self.shard = shard
        self.token = token
        self.storage_roots = resolve_storage_roots(storage_roots)
        self.segments = shm_mod.SegmentCache()

    def _check(self, context) -> None:
        if self.token is None:
            return
        got = dict(context.invocation_metadata()).get(TOKEN_HEADER, "")
        if not hmac.compare_digest(got.encode(), self.token.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong parameter-server token")

    def _wrap(self, fn):
        def handler(request: bytes, context) -> bytes:
            self._check(context)
            try:
                meta, arrays = wire.decode(request)
                shm = meta.pop("shm", None)
                buf = None
                if shm is not None:  # the arrays are in the client's shared-memory segment (persia_core.ps.shm)
                    buf = self.segments.get(shm.get("name"), shm.get("size", 0))
                    arrays = shm_mod.views(buf, shm.get("arrays", []))
                out_meta, out_arrays = fn(meta, arrays, context)
                if buf is not None and out_arrays:
                    entries = shm_mod.write_reply(buf, shm.get("out", [0, 0]), out_arrays)
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

        return grpc.unary_unary_rpc_method_handler(handler)

    def handlers(self) -> grpc.GenericRpcHandler:
        s = self.shard

        def lookup(meta, arrays, ctx):
            return {}, {"rows": s.lookup(meta["table"], check_ids(arrays["ids"]))}

        def lookup_readonly(meta, arrays, ctx):
            return {}, {"rows": s.table(meta["table"]).lookup_readonly(check_ids(arrays["ids"]))}

        def push(meta, arrays, ctx):
            remaining = ctx.time_remaining()
            return s.push(meta, arrays["ids"], arrays["grads"], remaining), {}

        def contains(meta, arrays, ctx):
            return {}, {"found": s.table(meta["table"]).contains(check_ids(arrays["ids"])).astype(np.uint8)}

        def dump(meta, arrays, ctx):
            nbytes, crc = s.dump(check_storage_path(meta.get("path"), self.storage_roots))
            return {"bytes": nbytes, "crc32c": crc}, {}

        def load(meta, arrays, ctx):
            s.load(check_storage_path(meta.get("path"), self.storage_roots), meta.get("size"), meta.get("crc32c"))
            return {"ok": True}, {}

        def stats(meta, arrays, ctx):
            return s.stats(), {}

        def health(meta, arrays, ctx):
            return {"ok": True, "shard": s.shard, "pid": os.getpid()}, {}

        methods = {
            "Lookup": lookup,
            "LookupReadonly": lookup_readonly,
            "Push": push,
            "Contains": contains,
            "Dump": dump,
            "Load": load,
            "Stats": stats,
            "Health": health,
        }
        return grpc.method_handlers_generic_handler(SERVICE, {k: self._wrap(v) for k, v in methods.items()})


def serve(
    shard: ParameterServerShard,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    max_workers: int = 32,
    storage_roots: list[str] | None = None,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for ``shard`` on ``host:port`` (0 = any free port). Returns (server, bound port).
    ``storage_roots``: where ``Dump`` and ``Load`` may write and read (``check_storage_path``; None: anywhere).

    Raises ``RuntimeError`` if the port cannot be bound, ``TypeError``/``ValueError`` for bad storage roots
    (``resolve_storage_roots``)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((_Servicer(shard, token, storage_roots).handlers(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"parameter server could not bind {host}:{port}")
    server.start()
    return server, bound


def warm_up(config: RunConfig) -> None:
    """Run each table's lookup, read-only lookup and gradient apply once on a throwaway 1024-row table of the same
    dim, optimizer and storage, so that the compiled kernels are compiled (or loaded from numba's cache) before
    the server takes calls: on a fresh container the first call would otherwise spend its deadline compiling."""
    tables = make_tables(
        config.embedding.tables,
        0,
        config.trainer.seed,
        capacities={t.name: 1024 for t in config.embedding.tables},
        storage=config.embedding.storage,
    )
    ids = np.arange(8, dtype=np.uint64)
    for t in tables.values():
        t.lookup(ids)
        t.lookup_readonly(ids)
        t.apply_gradients(ids, np.zeros((len(ids), t.dim), np.float32))


def main(argv: list[str] | None = None) -> int:
    """Run one parameter-server shard until SIGTERM/SIGINT. See ``--help``."""
    p = argparse.ArgumentParser(prog="persia_core.ps.server", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="run config (YAML path or shipped name)")
    p.add_argument("--shard", type=int, required=True, help="this shard's index")
    p.add_argument("--num-shards", type=int, required=True, help="shards in the plan")
    p.add_argument("--plan", default="", help="shard_plan.json from init_shards (row capacities)")
    p.add_argument("--init", default="", help="shard file to start from (initial state or checkpoint)")
    p.add_argument("--init-size", type=int, default=None, help="refuse --init unless it has this many bytes")
    p.add_argument("--init-crc32c", type=int, default=None, help="refuse --init unless its CRC-32C is this")
    p.add_argument("--delta-dir", default="", help="write incremental exports (delta files) under this folder")
    p.add_argument("--delta-every-s", type=float, default=0.0, help="seconds between delta files (0: off)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=0, help="port (0 = pick a free one)")
    p.add_argument("--port-file", default="", help="write the bound port here once serving")
    p.add_argument(
        "--storage-root",
        action="append",
        default=None,
        type=storage_root,
        help="a folder (or URL prefix such as gs://bucket/run) under which Dump and Load may write and "
        f"read; repeatable (default: ${STORAGE_ROOTS_ENV}, comma-separated; none: any path)",
    )
    args = p.parse_args(argv)
    env_roots = os.environ.get(STORAGE_ROOTS_ENV, "")
    roots = (
        args.storage_root
        if args.storage_root is not None
        else ([r.strip() for r in env_roots.split(",")] if env_roots else [])
    )  # a blank entry is refused below
    try:
        roots = resolve_storage_roots(roots)
    except ValueError as e:  # from the environment variable (the flag's values were checked by argparse)
        p.error(f"{STORAGE_ROOTS_ENV}: {e}")
    from persia_core.logging_utils import setup_logging

    setup_logging("ps", args.shard)
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.error(
            "refusing to serve on %s without a token: set %s (remote calls need a shared token)", args.host, TOKEN_ENV
        )
        return 2
    config = load_config(args.config)
    capacities = None
    if args.plan:
        plan = json.loads(io.read_text(args.plan))
        capacities = {n: t["capacity_rows_per_shard"] for n, t in plan["tables"].items()}
    shard = ParameterServerShard(config, args.shard, args.num_shards, capacities)
    if args.init:
        t0 = time.perf_counter()
        try:
            shard.load(args.init, args.init_size, args.init_crc32c)
        except (ValueError, FileNotFoundError) as e:  # ShardFileError, or a path that is no regular file
            log.error("refused the state to start from: %s", e)
            return EXIT_BAD_INIT
        log.info(
            "loaded %s in %.2f s (%s rows)",
            args.init,
            time.perf_counter() - t0,
            {n: t.size for n, t in shard.tables.items()},
        )
    if args.delta_dir and args.delta_every_s > 0:
        shard.start_deltas(args.delta_dir, args.delta_every_s)
        log.info("incremental export every %.1f s to %s", args.delta_every_s, args.delta_dir)
    t0 = time.perf_counter()
    warm_up(config)
    log.info("compiled kernels ready in %.2f s", time.perf_counter() - t0)
    # the loaded tables live until the end: keep their objects out of the garbage collector's scans
    import gc

    gc.collect()
    gc.freeze()
    server, port = serve(shard, args.host, args.port, token, storage_roots=roots)
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    log.info(
        "serving shard %d/%d on %s:%d (token %s; Dump/Load %s)",
        args.shard,
        args.num_shards,
        args.host,
        port,
        "required" if token else "off",
        f"under {', '.join(roots)}" if roots else "anywhere",
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    stop.wait()
    if shard.exporter is not None:
        shard.exporter.stop()
    server.stop(grace=2).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
