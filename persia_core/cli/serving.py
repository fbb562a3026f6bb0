"""``persia serve``: an HTTP prediction server for a Model (``persia_core.serve.server``)."""

from __future__ import annotations

import os

from persia_core.argchecks import float_in, int_at_least, port_number
from persia_core.cli.common import EXIT_OK, AddCommand


def _route(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"a route starts with '/', got {value!r}")
    return value


def cmd_serve(args, _extra) -> int:
    from persia_core.serve.server import serve

    if args.model and args.follow:
        raise ValueError("give --model or --follow, not both (--follow serves the latest model of its location)")
    model = args.follow or args.model or os.environ.get("AIP_STORAGE_URI", "")
    if not model:
        raise ValueError("--model is needed (or AIP_STORAGE_URI, which Vertex AI sets to the deployed model's folder)")
    port = args.port
    if port is None:
        text = os.environ.get("AIP_HTTP_PORT") or "8080"
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise ValueError(f"AIP_HTTP_PORT must be a port number, got {text!r}")
        port = int(text)
    serve(
        model,
        host=args.host,
        port=port,
        predict_route=_route(args.predict_route),
        health_route=_route(args.health_route),
        max_request_bytes=args.max_request_bytes,
        body_timeout_s=args.body_timeout_seconds,
        drain_s=args.drain_seconds,
        threads=args.threads,
        follow=bool(args.follow),
        poll_s=args.poll_seconds,
        deltas=args.deltas,
    )
    return EXIT_OK


def add_commands(add: AddCommand) -> None:
    """Add the parser of ``serve``."""
    env = os.environ
    sp = add(
        "serve",
        'Serve a Model\'s predictions over HTTP (POST {"instances": [...]} -> {"predictions": [...]}), in Vertex '
        "AI's custom-container contract (AIP_HTTP_PORT, AIP_PREDICT_ROUTE, AIP_HEALTH_ROUTE, AIP_STORAGE_URI), "
        "embedding rows in memory, read-only. Not 'serve-shards', which starts parameter servers for training.",
        cmd_serve,
    )
    sp.add_argument("--model", default="", help="Model folder or blessed-model location (default: $AIP_STORAGE_URI)")
    sp.add_argument(
        "--follow",
        default="",
        metavar="BLESSED_DIR",
        help="follow mode: serve the latest model of this blessed-model location and swap to each one blessed there "
        "later, without failing a request (a model that cannot be loaded leaves the old one serving)",
    )
    sp.add_argument(
        "--deltas",
        default="",
        metavar="DELTA_DIR",
        help="apply the delta files of a training run that warm-started from the served model (its delta_dir) as "
        "they come: rows not yet through the evaluate step's gate (PERSIA's online update); deltas of a run that "
        "started from another model wait, superseded ones are skipped; freshness in /metrics and health",
    )
    sp.add_argument(
        "--poll-seconds",
        type=float_in(0.05),
        default=5.0,
        help="follow mode and --deltas: how often the blessed marker and the delta folder are read (default 5)",
    )
    sp.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; the serving image passes 0.0.0.0, as Vertex AI needs)",
    )
    sp.add_argument(
        "--port",
        type=port_number,
        default=None,
        help="port (default: $AIP_HTTP_PORT, else 8080)",
    )
    sp.add_argument(
        "--predict-route",
        default=env.get("AIP_PREDICT_ROUTE") or "/predict",
        help="prediction route (default: $AIP_PREDICT_ROUTE, else /predict)",
    )
    sp.add_argument(
        "--health-route",
        default=env.get("AIP_HEALTH_ROUTE") or "/health",
        help="health route (default: $AIP_HEALTH_ROUTE, else /health)",
    )
    sp.add_argument(
        "--max-request-bytes",
        type=int_at_least(1024),
        default=8 << 20,
        help="larger request bodies get 413 (default 8 MiB; Vertex AI's online limit is 1.5 MB)",
    )
    sp.add_argument(
        "--body-timeout-seconds",
        type=float_in(0.001),
        default=30.0,
        help="a request body not all there this long after its headers gets 408 (default 30)",
    )
    sp.add_argument(
        "--drain-seconds",
        type=float_in(0.0),
        default=30.0,
        help="on SIGTERM, how long requests in flight may take to finish (default 30)",
    )
    sp.add_argument(
        "--threads",
        type=int_at_least(0),
        default=0,
        help="requests whose dense network runs at once, one torch thread each (default 0: the machine's cores, "
        "at most 4)",
    )
