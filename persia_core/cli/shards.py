"""``persia plan`` and ``serve-shards``: capacity planning, and parameter-server shards started by hand."""

from __future__ import annotations

import glob
import importlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

from persia_core.argchecks import int_at_least, storage_root
from persia_core.cli.common import EXIT_BAD_INPUT, EXIT_OK, AddCommand, print_json, run_config
from persia_core.model_store import is_blessed_location, latest_blessed_model

log = logging.getLogger("persia.cli")


def cmd_plan(args, extra: list[str]) -> int:
    """Run the capacity planner's ``main`` on every argument after ``plan``, as they are."""
    planner = importlib.import_module("persia_core.planner")  # the module in sys.modules, as a test may set it
    try:
        rc = planner.main(list(extra))
    except SystemExit as e:  # the planner's argparse: --help (0) or a usage error (2)
        rc = e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_BAD_INPUT)
    return rc if isinstance(rc, int) else EXIT_OK


def cmd_serve_shards(args, _extra) -> int:
    from persia_core.train.local_cluster import LocalCluster

    config = run_config(args.config, [], args.set)
    n = args.num_shards or config.embedding.num_shards
    if args.plan and not os.path.exists(args.plan):
        raise FileNotFoundError(f"--plan {args.plan} not found")
    if args.init and not os.path.isdir(args.init):
        raise FileNotFoundError(f"--init {args.init} is not a folder")
    if args.init:
        if is_blessed_location(args.init):  # a blessed-model location: its latest blessed model
            args.init = latest_blessed_model(args.init)
            log.info("serving the latest blessed model, %s", args.init)
        have = len(glob.glob(os.path.join(args.init, "shards", "shard-*.npz")))
        if have == 0:  # every server would start empty, and nothing would say so
            raise FileNotFoundError(
                f"--init {args.init}: no shard files (shards/shard-*.npz); give an init-shards "
                f"output, a Model folder or a blessed-model location"
            )
        if have != n:  # each server loads the file of its own shard number: the others would be lost
            raise ValueError(
                f"--init {args.init} holds {have} shard files but {n} shards were asked: serve it with "
                f"--num-shards {have}, or re-shard it first (init-shards warm-started from it)"
            )

    own_work_dir = not args.work_dir  # a temporary folder: removed on a clean stop, kept (and named) on a failure
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="persia-serve-")
    os.makedirs(work_dir, exist_ok=True)
    cfg_path = os.path.join(work_dir, "run_config.yaml")
    with open(cfg_path, "w") as f:
        f.write(config.to_yaml())
    token_file = os.path.join(work_dir, "ps_token")

    def _stop(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _stop)
    clean = False
    try:
        dumps = os.path.join(work_dir, "dumps")  # default storage root: beside, not over, the token and config
        if not args.storage_root:
            os.makedirs(dumps, exist_ok=True)
        with LocalCluster(
            cfg_path, n, 0, work_dir, args.plan or "", args.init or "", storage_roots=args.storage_root or [dumps]
        ) as cluster:
            addresses = cluster.start_servers()
            try:  # from here on a stop signal is a clean stop, even one that comes as the addresses are printed
                fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(cluster.token)
                print_json(
                    {
                        "addresses": addresses,
                        "token_file": token_file,
                        "logs": os.path.join(work_dir, "logs"),
                        "storage_roots": cluster.storage_roots,
                    }
                )
                sys.stdout.flush()
                log.info("serving %d shard(s); Ctrl-C stops them", n)
                while True:
                    for p in cluster.servers:
                        rc = p.popen.poll()
                        if rc is not None:
                            raise RuntimeError(f"{p.name} exited with code {rc}; last log lines:\n{p.tail()}")
                    time.sleep(0.5)
            except KeyboardInterrupt:
                log.info("stopping the parameter servers")
                clean = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        if os.path.exists(token_file):  # the servers are gone: their token opens nothing, and is not left lying
            os.remove(token_file)
        kept_dumps = os.path.isdir(dumps) and bool(os.listdir(dumps))
        if os.path.isdir(dumps) and not kept_dumps:
            os.rmdir(dumps)  # empty: kept only when it holds files
        if own_work_dir and clean and not kept_dumps:
            shutil.rmtree(work_dir, ignore_errors=True)
        elif own_work_dir and clean:
            print(f"persia serve-shards: the shard files dumped are kept in {dumps}", file=sys.stderr)
        elif own_work_dir:
            print(
                f"persia serve-shards: the servers' logs are kept in {os.path.join(work_dir, 'logs')}", file=sys.stderr
            )
    return EXIT_OK


def add_commands(add: AddCommand) -> None:
    """Add the parsers of ``plan`` and ``serve-shards``."""
    add(
        "plan",
        "Capacity planning (persia_core.planner); every argument after 'plan' is passed to it as it is "
        "(try: persia plan --help).",
        cmd_plan,
        add_help=False,
    )

    sp = add(
        "serve-shards",
        "Start N embedding parameter-server shards on 127.0.0.1, print their addresses "
        "and the token file, and serve until Ctrl-C.",
        cmd_serve_shards,
    )
    sp.add_argument("--config", required=True, help="run config: a shipped name or a YAML path")
    sp.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override one config field (repeatable)"
    )
    sp.add_argument(
        "--num-shards", type=int_at_least(0), default=0, help="shards to start (default: embedding.num_shards)"
    )
    sp.add_argument("--plan", default="", help="shard_plan.json from init-shards (row capacities)")
    sp.add_argument(
        "--init",
        default="",
        help="init-shards output, Model folder or blessed-model location: the shards/shard-*.npz to load",
    )
    sp.add_argument("--work-dir", default="", help="folder for logs, port files and the token file")
    sp.add_argument(
        "--storage-root",
        action="append",
        default=[],
        metavar="DIR",
        type=storage_root,
        help="a folder (or gs:// prefix) under which the servers' Dump and Load may write and read; "
        "repeatable (default: <work dir>/dumps, kept after a stop when it holds files)",
    )
