"""Embedding parameter server: one process per shard, serving its ``EmbeddingTable``s over gRPC.

    python -m persia_core.ps.server --config CFG --shard I --num-shards N [--plan ...] [--init ...]

The launchers start one such process per shard (``persia_core.train.launcher``, ``persia_core.cluster``). The
shard's state and push semantics are ``persia_core.ps.shard``'s; the gRPC service (calls, status codes, token,
shared-memory transport) is ``persia_core.ps.servicer``'s.

Incremental export (``--delta-dir``, ``--delta-every-s``): every T seconds the rows created or updated since the
last export are written as a delta file (``persia_core.embedding.delta``), and once more when the server stops.

Exit codes of ``main``: 0 stopped by SIGTERM/SIGINT; 3 the ``--init`` state was refused (missing, partial or
corrupt: the log's last line says which check failed); other non-zero: a crash.

Security: binds 127.0.0.1 unless ``--host`` says otherwise, and refuses to bind any other address without a
token; when ``PERSIA_PS_TOKEN`` is set every call must carry it in the ``x-persia-token`` metadata, else it is
refused with UNAUTHENTICATED. ``Dump`` and ``Load`` reach only paths under the server's storage roots
(``--storage-root``, repeatable, or ``PERSIA_PS_STORAGE_ROOTS``, comma-separated; the launchers pass the run's
model and checkpoint folders): any other path is refused with PERMISSION_DENIED. A server started without roots
writes and reads any path it can (the token is then the only guard).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import threading
import time

from persia_core import io
from persia_core.allocator import keep_freed_memory
from persia_core.argchecks import port_number, storage_root
from persia_core.config import load_config
from persia_core.logging_utils import setup_logging
from persia_core.process_exit import exit_now
from persia_core.ps.protocol import EXIT_BAD_INIT, EXIT_PORT_IN_USE, STORAGE_ROOTS_ENV, TOKEN_ENV
from persia_core.ps.servicer import PortInUse, serve
from persia_core.ps.shard import ParameterServerShard, warm_up
from persia_core.ps.storage_roots import resolve_storage_roots
from persia_core.train.processes import die_with_spawner

log = logging.getLogger("persia.ps")


def main(argv: list[str] | None = None) -> int:
    """Run one parameter-server shard until SIGTERM/SIGINT. See ``--help``."""
    p = argparse.ArgumentParser(prog="persia_core.ps.server", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="run config (YAML path or shipped name)")
    p.add_argument("--shard", type=int, required=True, help="this shard's index")
    p.add_argument("--num-shards", type=int, required=True, help="shards in the plan")
    p.add_argument(
        "--plan",
        default="",
        help="shard_plan.json from init_shards (row capacities; the model warm-started from, named in deltas)",
    )
    p.add_argument("--init", default="", help="shard file to start from (initial state or checkpoint)")
    p.add_argument("--init-size", type=int, default=None, help="refuse --init unless it has this many bytes")
    p.add_argument("--init-crc32c", type=int, default=None, help="refuse --init unless its CRC-32C is this")
    p.add_argument("--delta-dir", default="", help="write incremental exports (delta files) under this folder")
    p.add_argument("--delta-every-s", type=float, default=0.0, help="seconds between delta files (0: off)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=port_number, default=0, help="port (0 = pick a free one)")
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
    if not die_with_spawner():  # the launcher died before this process could follow it
        return 1
    keep_freed_memory()  # every call allocates its rows and IDs afresh: reuse the memory, no page faults
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
    setup_logging("ps", args.shard)
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.error(
            "refusing to serve on %s without a token: set %s (remote calls need a shared token)", args.host, TOKEN_ENV
        )
        return 2
    config = load_config(args.config)
    capacities, base = None, ""
    if args.plan:
        plan = json.loads(io.read_text(args.plan))
        capacities = {n: t["capacity_rows_per_shard"] for n, t in plan["tables"].items()}
        base = str((plan.get("warm_start") or {}).get("manifest_digest", ""))
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
        shard.start_deltas(args.delta_dir, args.delta_every_s, base_model=base)
        log.info("incremental export every %.1f s to %s", args.delta_every_s, args.delta_dir)
    t0 = time.perf_counter()
    warm_up(config)
    log.info("compiled kernels ready in %.2f s", time.perf_counter() - t0)
    # the loaded tables live until the end: keep their objects out of the garbage collector's scans
    gc.collect()
    gc.freeze()
    try:
        server, port = serve(shard, args.host, args.port, token, storage_roots=roots)
    except PortInUse as e:
        log.error("%s", e)
        return EXIT_PORT_IN_USE
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
        try:  # the rows changed since the last export, so that a consumer of the deltas reaches the final state
            shard.export_delta()
        except Exception:
            log.exception("the last delta export failed")
    server.stop(grace=2).wait()
    return 0


if __name__ == "__main__":
    exit_now(main())
