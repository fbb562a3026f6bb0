"""One replica of a Vertex AI CustomJob: find this replica's role and peers from ``CLUSTER_SPEC`` and run it.

Roles by worker pool (the layout, the ``CLUSTER_SPEC`` shape and the address arithmetic: ``persia_core.cluster_spec``):
pool 0 the primary (NN worker of rank 0; after training it has the servers dump their shards and writes the Model's
manifest), pool 1 the other NN workers, pool 2 the parameter servers, pool 3 (optional) the embedding workers on
CPU machines of their own (``--embedding-workers`` E per NN worker, ``--embedding-workers-per-replica`` processes
per replica; each serves its NN worker over a gRPC stream, ``persia_core.train.ready_stream``). Without pool 3 each
NN worker runs its embedding workers beside it (``trainer.embedding_workers``, shared memory).

Parameter servers and pool-3 embedding workers listen beyond loopback, so a token is required: ``$PERSIA_PS_TOKEN``, or
``$PERSIA_PS_TOKEN_SECRET`` naming a Secret Manager version (``projects/P/secrets/S/versions/latest``). The job
ends when the primary exits; parameter servers also exit once the primary has written ``DONE_MARKER`` into the
control folder, so the job ends under any pool semantics.

Restarts: every replica looks for the newest complete checkpoint of the run (``--resume auto``, the default); the
parameter servers load its shard files (size and CRC-32C checked) and the NN workers continue from its step, so a
job that Vertex AI restarts after a failure or a preemption resumes instead of starting over.

Entry point (the same command in every pool)::

    python -m persia_core.cluster --config /gcs/b/shards/run_config.yaml --data /gcs/b/dataset \\
        --init /gcs/b/shards --out /gcs/b/model --control /gcs/b/job/control [-- more NN worker flags]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping

from persia_core import checkpoints as ckpt
from persia_core import io
from persia_core.checkpoints import checkpoint_settings, lineage
from persia_core.cluster_spec import (
    EMBEDDING_WORKER,
    PARAMETER_SERVER,
    PRIMARY,
    Placement,
    parse_cluster_spec,
    placement,
)
from persia_core.config import load_config
from persia_core.data.reader import read_schema
from persia_core.model_store import shard_file_name
from persia_core.process_exit import exit_now
from persia_core.ps.client import EmbeddingClient, ParameterServerError
from persia_core.ps.protocol import TOKEN_ENV, TOKEN_SECRET_ENV
from persia_core.train.model_output import finish_model
from persia_core.train.processes import spawn

DONE_MARKER = "TRAINING_DONE"
log = logging.getLogger("persia.cluster")


def resolve_token(environ: Mapping[str, str] | None = None) -> str:
    """The parameter servers' shared token: ``$PERSIA_PS_TOKEN``, else the Secret Manager version named by
    ``$PERSIA_PS_TOKEN_SECRET``. Raises ``ValueError`` when neither is set (servers bound beyond loopback must
    not run without one)."""
    environ = os.environ if environ is None else environ
    token = environ.get(TOKEN_ENV, "")
    if token:
        return token
    secret = environ.get(TOKEN_SECRET_ENV, "")
    if secret:
        from google.cloud import secretmanager

        resp = secretmanager.SecretManagerServiceClient().access_secret_version(request={"name": secret})
        token = resp.payload.data.decode("utf-8").strip()
        if token:
            return token
        raise ValueError(f"{TOKEN_SECRET_ENV}={secret}: the secret is empty")
    raise ValueError(
        f"no parameter-server token: set {TOKEN_ENV} or {TOKEN_SECRET_ENV} (a Secret Manager "
        f"version, projects/P/secrets/S/versions/latest)"
    )


def wait_for_servers(addresses: list[str], config, token: str, timeout_s: float) -> None:
    """Block until every parameter server answers ``Health`` (replicas start in any order).

    Raises ``TimeoutError`` naming the servers still silent after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    pending = list(range(len(addresses)))
    client = EmbeddingClient(addresses, config.embedding, token=token, retries=0)
    try:
        while pending:
            still = []
            for s in pending:
                try:
                    client.call("Health", s, timeout_s=5.0)
                except ParameterServerError:
                    still.append(s)
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"parameter servers not answering after {timeout_s:.0f} s: {[addresses[s] for s in pending]}"
                    )
                time.sleep(2.0)
    finally:
        client.close()


def wait_for_embedding_workers(addresses: list[str], timeout_s: float) -> None:
    """Block until every embedding worker of pool 3 accepts connections (replicas start in any order).

    Raises ``TimeoutError`` naming those still unreachable after ``timeout_s`` seconds."""
    import grpc

    deadline = time.monotonic() + timeout_s
    pending = list(addresses)
    while pending:
        still = []
        for a in pending:
            with grpc.insecure_channel(a) as ch:
                try:
                    grpc.channel_ready_future(ch).result(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                except grpc.FutureTimeoutError:
                    still.append(a)
        pending = still
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"embedding workers not reachable after {timeout_s:.0f} s: {pending}")


def finalize_model(
    config,
    data_dir: str,
    model_dir: str,
    addresses: list[str],
    token: str,
    wall_seconds: float,
    deltas: dict | None = None,
) -> dict:
    """After the last step: every server dumps its shard into ``model_dir``; the manifest is written last, by the
    same writer as a local run's (``persia_core.train.model_output.finish_model``): shard CRC-32Cs and lineage
    included, and ``deltas`` (where the servers wrote incremental exports) where given. Returns the manifest."""
    n = len(addresses)
    client = EmbeddingClient(addresses, config.embedding, token=token)
    try:
        dumped = client.dump([io.join(model_dir, shard_file_name(s)) for s in range(n)])
        stats = client.stats()
    finally:
        client.close()
    return finish_model(
        model_dir, config, read_schema(data_dir), dumped, stats, wall_seconds, lineage(config, data_dir), deltas=deltas
    )


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` in ``argv`` (the last one), else None."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def checkpoint_folder(args, config) -> str:
    """The run's checkpoint folder: ``--checkpoint-dir`` among the NN worker flags, else ``trainer.checkpoint_dir``,
    else ``<out>/checkpoints``."""
    return _flag(args.worker_args, "--checkpoint-dir") or checkpoint_settings(config, args.out).dir


def resume_point(args, config) -> tuple[str, dict] | None:
    """The checkpoint a (re)started job continues from, the same for every replica.

    ``--resume auto`` (default): the newest complete checkpoint in the run's checkpoint folder (``--checkpoint-dir``
    among the NN worker flags, else ``trainer.checkpoint_dir``, else ``<out>/checkpoints``), None when there is
    none; ``--resume PATH``: exactly that checkpoint; ``--resume ''``: start afresh. Raises ``CheckpointError``
    when the checkpoint belongs to another run (config or data lineage) or holds another number of shards than
    the run config (re-shard it with ``persia_core.embedding.plan`` first)."""
    explicit = _flag(args.worker_args, "--resume")
    where = explicit if explicit is not None else args.resume
    if not where:
        return None
    if where == "auto":
        chosen = ckpt.find_latest(checkpoint_folder(args, config))
        if chosen is None:
            return None
    else:
        chosen = (where, ckpt.verify(where, deep=True, deep_roles=("dense", "worker")))
    path, manifest = chosen
    ckpt.check_lineage(manifest, ckpt.lineage(config, args.data), path)
    shards = [e for e in manifest["files"] if e.get("role") == "shard"]
    if len(shards) != config.embedding.num_shards:
        raise ckpt.CheckpointError(
            f"{path} holds {len(shards)} shards but the run config has "
            f"embedding.num_shards={config.embedding.num_shards}"
        )
    return chosen


def _run_nn_worker(args, place: Placement, config, token: str) -> int:
    # lazy: torch, for the NN roles only; a parameter-server replica's supervisor never loads it
    from persia_core.train import worker

    t0 = time.time()
    log.info(
        "%s rank %d/%d, rendezvous %s:%d, %d parameter servers",
        place.role,
        place.rank,
        place.world_size,
        place.master_addr,
        place.master_port,
        len(place.ps_addresses),
    )
    wait_for_servers(place.ps_addresses, config, token, args.ps_wait_s)
    ours = [a for j in range(place.local_ranks) for a in place.rank_ew_addresses(place.rank + j)]
    if ours:
        wait_for_embedding_workers(ours, args.ps_wait_s)
    worker_args = ["--config", args.config, "--data", args.data, "--out", args.out, *args.worker_args]
    resume = resume_point(args, config)
    if resume is not None and _flag(args.worker_args, "--resume") is None:
        worker_args += ["--resume", resume[0]]
        log.info("resuming from %s (step %d)", resume[0], resume[1]["step"])
    if place.local_ranks == 1:
        os.environ.update(place.env())
        os.environ[TOKEN_ENV] = token
        rc = worker.main(worker_args)
    else:
        rc = _run_local_ranks(place, token, worker_args)
    if rc != 0 or place.role != PRIMARY:
        return rc
    deltas = (
        {"dir": args.delta_dir, "every_s": args.delta_every_s} if args.delta_dir and args.delta_every_s > 0 else None
    )
    manifest = finalize_model(config, args.data, args.out, place.ps_addresses, token, time.time() - t0, deltas)
    log.info("model written to %s (%d shards)", args.out, manifest["num_shards"])
    if args.control:
        io.write_text(io.join(args.control, DONE_MARKER), json.dumps({"model": args.out, "time": time.time()}))
    return 0


def _run_local_ranks(place: Placement, token: str, worker_args: list[str]) -> int:
    """Run this replica's ranks as child processes; the first failure stops the others. Returns an exit code."""
    procs = []
    for j in range(place.local_ranks):
        env = dict(os.environ, **place.env(j), **{TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"})
        env.pop(TOKEN_SECRET_ENV, None)
        procs.append(spawn([sys.executable, "-m", "persia_core.train.worker", *worker_args], env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad:
                log.error("an NN worker process exited with code %s", bad[0])
                return bad[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _run_parameter_server(args, place: Placement, config, token: str) -> int:
    n = len(place.ps_addresses)
    env = dict(os.environ, **{TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"})
    env.pop(TOKEN_SECRET_ENV, None)
    plan = io.join(args.init, "shard_plan.json") if args.init else ""
    resume = resume_point(args, config)
    from_ckpt: dict[int, dict] = {}
    resume_dir = ""
    if resume is not None:
        resume_dir = resume[0]
        for e in resume[1]["files"]:
            if e.get("role") == "shard":
                from_ckpt[int(e["shard"])] = e
        log.info("parameter servers resume from %s (step %d)", resume[0], resume[1]["step"])
    # Dump and Load reach only the run's model folder and checkpoint folder
    storage_roots = list(dict.fromkeys([args.out, checkpoint_folder(args, config)]))
    started = time.time()
    procs = []
    for shard, port in zip(place.shards, place.ports, strict=True):
        cmd = [
            sys.executable,
            "-m",
            "persia_core.ps.server",
            "--config",
            args.config,
            "--shard",
            str(shard),
            "--num-shards",
            str(n),
            "--host",
            args.host,
            "--port",
            str(port),
        ]
        if plan and io.exists(plan):
            cmd += ["--plan", plan]
        for root in storage_roots:
            cmd += ["--storage-root", root]
        init = io.join(args.init, shard_file_name(shard)) if args.init else ""
        if shard in from_ckpt:
            e = from_ckpt[shard]
            cmd += [
                "--init",
                io.join(resume_dir, e["path"]),
                "--init-size",
                str(e["bytes"]),
                "--init-crc32c",
                str(e["crc32c"]),
            ]
        elif init and io.exists(init):
            cmd += ["--init", init]
        if args.delta_dir and args.delta_every_s > 0:
            cmd += ["--delta-dir", args.delta_dir, "--delta-every-s", str(args.delta_every_s)]
        log.info("parameter server: shard %d/%d on %s:%d", shard, n, args.host, port)
        procs.append(spawn(cmd, env))
    done = io.join(args.control, DONE_MARKER) if args.control else ""
    try:
        while True:
            for shard, p in zip(place.shards, procs, strict=True):
                if p.poll() is not None:
                    log.error("parameter server of shard %d exited with code %s", shard, p.returncode)
                    return p.returncode or 1
            if done and io.exists(done) and _marker_time(done) >= started:
                log.info("primary finished (%s); stopping", done)
                return 0
            time.sleep(args.poll_s)
    finally:
        _stop(procs)


def _run_embedding_workers(args, place: Placement, token: str) -> int:
    """Pool 3: one embedding-worker process per port, each serving the NN worker that connects (it sends its
    spec). Returns 0 once all have served theirs and stopped, else the first failing exit code; they also stop
    when the primary's done marker appears."""
    env = dict(os.environ, **{TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"})
    env.pop(TOKEN_SECRET_ENV, None)
    started = time.time()
    procs = []
    for port in place.ports:
        cmd = [sys.executable, "-m", "persia_core.train.embedding_worker", "--listen", f"{args.host}:{port}"]
        log.info("embedding worker on %s:%d", args.host, port)
        procs.append(spawn(cmd, env))
    done = io.join(args.control, DONE_MARKER) if args.control else ""
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(port, c) for port, c in zip(place.ports, codes, strict=True) if c not in (None, 0)]
            if bad:
                log.error("embedding worker on port %d exited with code %s", *bad[0])
                return bad[0][1]
            if all(c == 0 for c in codes):
                return 0
            if done and io.exists(done) and _marker_time(done) >= started:
                log.info("primary finished (%s); stopping", done)
                return 0
            time.sleep(min(args.poll_s, 1.0))
    finally:
        _stop(procs)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process still running, then wait for each, SIGKILLing one that takes over 10 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _marker_time(path: str) -> float:
    """When the done marker at ``path`` was written (seconds since the epoch; 0 for an older marker without it),
    so servers of a restarted job do not stop on the marker of an earlier attempt."""
    try:
        return float(json.loads(io.read_text(path)).get("time", 0.0))
    except (ValueError, OSError, AttributeError):
        return 0.0


def run_replica(args: argparse.Namespace, cluster_spec: str) -> int:
    """Run this replica's role (see module docstring). Returns the exit code.

    Raises ``ValueError`` for a bad ``CLUSTER_SPEC``, a missing token or a shard count that does not match
    ``embedding.num_shards`` of the run config."""
    spec = parse_cluster_spec(cluster_spec)
    place = placement(
        spec, args.shards_per_server, args.ranks_per_replica, args.embedding_workers, args.embedding_workers_per_replica
    )
    config = load_config(args.config)
    if len(place.ps_addresses) != config.embedding.num_shards:
        raise ValueError(
            f"{len(spec.pools[2])} parameter-server replicas x {args.shards_per_server} shards each "
            f"= {len(place.ps_addresses)} shards, but the run config has embedding.num_shards="
            f"{config.embedding.num_shards}"
        )
    if place.role != PARAMETER_SERVER and place.world_size != config.trainer.num_workers:
        raise ValueError(
            f"{place.world_size} NN workers in the cluster (pools 0 and 1 x {args.ranks_per_replica} "
            f"ranks each), but the run config has trainer.num_workers={config.trainer.num_workers}"
        )
    token = resolve_token()
    if place.role == PARAMETER_SERVER:
        return _run_parameter_server(args, place, config, token)
    if place.role == EMBEDDING_WORKER:
        return _run_embedding_workers(args, place, token)
    return _run_nn_worker(args, place, config, token)


def main(argv: list[str] | None = None) -> int:
    """Entry point of every replica of a Vertex AI CustomJob (``python -m persia_core.cluster``)."""
    p = argparse.ArgumentParser(prog="persia_core.cluster", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="run config YAML (init_shards' run_config.yaml)")
    p.add_argument("--data", required=True, help="preprocess output folder")
    p.add_argument("--init", default="", help="init_shards output folder (shard plan + initial shards)")
    p.add_argument("--out", required=True, help="Model folder to write")
    p.add_argument(
        "--control", default="", help="folder for the primary's done marker (parameter servers exit when it appears)"
    )
    p.add_argument("--shards-per-server", type=int, default=1, help="shards per parameter-server replica")
    p.add_argument(
        "--ranks-per-replica",
        type=int,
        default=1,
        help="NN worker processes (DDP ranks) per NN replica, e.g. one per GPU",
    )
    p.add_argument(
        "--embedding-workers",
        type=int,
        default=0,
        help="with an embedding-worker pool (pool 3): embedding workers per NN worker",
    )
    p.add_argument(
        "--embedding-workers-per-replica",
        type=int,
        default=1,
        help="embedding-worker processes per pool-3 replica (ports p .. p+n-1)",
    )
    p.add_argument(
        "--delta-dir",
        default="",
        help="parameter servers: folder of the incremental exports (deltas), stable across runs for online serving",
    )
    p.add_argument(
        "--delta-every-s", type=float, default=0.0, help="parameter servers: seconds between deltas (0: none)"
    )
    p.add_argument("--host", default="0.0.0.0", help="address parameter servers and embedding workers bind")
    p.add_argument("--ps-wait-s", type=float, default=900.0, help="how long NN workers wait for the servers")
    p.add_argument("--poll-s", type=float, default=10.0, help="parameter servers: done-marker poll interval")
    p.add_argument(
        "--resume",
        default="auto",
        help="checkpoint to continue from: 'auto' (the newest complete one "
        "in the run's checkpoint folder, if any; a restarted job "
        "continues where it stopped), a folder, or '' to start afresh",
    )
    p.add_argument(
        "worker_args",
        nargs="*",
        help="after '--': more arguments of every NN worker "
        "(persia_core.train.worker), e.g. warm-start or checkpoint flags",
    )
    args = p.parse_args(argv)
    spec = os.environ.get("CLUSTER_SPEC", "")
    if not spec:
        p.error(
            "CLUSTER_SPEC is not set (this entry point runs inside a Vertex AI CustomJob replica; locally "
            "use persia_core.train.launcher)"
        )
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s cluster %(message)s")
    return run_replica(args, spec)


if __name__ == "__main__":
    exit_now(main())
