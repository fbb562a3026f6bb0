"""One replica of a Vertex AI CustomJob: find this replica's role and peers from ``CLUSTER_SPEC`` and run it.

Vertex AI starts every replica of every worker pool with the same container command and sets ``CLUSTER_SPEC``::

    {"cluster": {"workerpool0": ["cmle-training-workerpool0-<id>-0:2222"],
                 "workerpool1": ["cmle-training-workerpool1-<id>-0:2222", ...],
                 "workerpool2": ["cmle-training-workerpool2-<id>-0:2222", ...]},
     "environment": "cloud",
     "task": {"type": "workerpool1", "index": 0, "trial": ""},
     "job": "<the CustomJobSpec as JSON>"}

Pools and roles (Vertex numbers pools by their place in ``workerPoolSpecs``)::

    pool 0  primary            exactly one: NN worker of DDP rank 0, the rendezvous host (MASTER_ADDR); after
                               training it has the servers dump their shards and writes the Model's manifest
    pool 1  NN workers         the other DDP ranks (replica i is rank i + 1); absent when M = 1
    pool 2  parameter servers  replica r serves shards r*k .. r*k+k-1 (k = --shards-per-server) on ports
                               p .. p+k-1, p = the port CLUSTER_SPEC gives it, bound on 0.0.0.0
    pool 3  unused             (refused)

So WORLD_SIZE = 1 + len(workerpool1), RANK as above, MASTER_ADDR:MASTER_PORT = workerpool0[0], and the
parameter-server address of shard s is ``host(workerpool2[s // k]):(port + s % k)``. With g ranks per replica
(``--ranks-per-replica``, e.g. one per GPU of an 8-GPU machine) every NN replica runs g worker processes:
replica j of the NN replicas (primary first) holds ranks j*g .. j*g+g-1 (``LOCAL_RANK`` 0..g-1) and
WORLD_SIZE = g * (1 + len(workerpool1)).

Parameter servers listen beyond loopback, so a token is required: ``$PERSIA_PS_TOKEN``, or
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
from dataclasses import dataclass, field

from persia_core import io
from persia_core.checkpoints import checkpoint_settings
from persia_core.model_store import shard_file_name
from persia_core.ps.protocol import TOKEN_ENV, TOKEN_SECRET_ENV
from persia_core.train.processes import die_with_parent

PRIMARY, NN_WORKER, PARAMETER_SERVER = "primary", "nn_worker", "parameter_server"
POOL_ROLES = {0: PRIMARY, 1: NN_WORKER, 2: PARAMETER_SERVER}
"""Worker-pool index -> role."""
DONE_MARKER = "TRAINING_DONE"
log = logging.getLogger("persia.cluster")


@dataclass(frozen=True)
class ClusterSpec:
    """``CLUSTER_SPEC`` parsed: the pools' ``host:port`` lists and this replica's pool and index."""

    pools: dict[int, list[str]]
    """pool index -> ``host:port`` of each replica, in replica order."""
    pool: int
    """This replica's pool index (``task.type`` = ``workerpool<pool>``)."""
    index: int
    """This replica's index within its pool (``task.index``)."""
    environment: str = "cloud"

    @property
    def role(self) -> str:
        return POOL_ROLES[self.pool]


def _host_port(address: str, where: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"CLUSTER_SPEC {where}: expected 'host:port', got {address!r}")
    return host, int(port)


def parse_cluster_spec(spec: str | dict) -> ClusterSpec:
    """Parse and validate ``CLUSTER_SPEC`` (a JSON string or its dict).

    Raises ``ValueError`` naming the offending field: not JSON, no ``cluster``/``task``, a pool name other than
    ``workerpool0..3``, pool 3 present (unused by this design), pool 0 without exactly one replica, a task
    outside the cluster, an address without a port."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"CLUSTER_SPEC is not JSON: {e}") from e
    if not isinstance(spec, dict):
        raise ValueError("CLUSTER_SPEC: expected a JSON object")
    cluster, task = spec.get("cluster"), spec.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError("CLUSTER_SPEC.cluster: missing or empty")
    if not isinstance(task, dict):
        raise ValueError("CLUSTER_SPEC.task: missing")
    pools: dict[int, list[str]] = {}
    for name, addresses in cluster.items():
        if not (name.startswith("workerpool") and name[len("workerpool") :].isdigit()):
            raise ValueError(f"CLUSTER_SPEC.cluster: unknown pool {name!r} (expected workerpool0..workerpool3)")
        idx = int(name[len("workerpool") :])
        if idx not in POOL_ROLES:
            raise ValueError(
                f"CLUSTER_SPEC.cluster.{name}: pool {idx} has no role here (pools 0, 1, 2: primary, "
                f"NN workers, parameter servers)"
            )
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ValueError(f"CLUSTER_SPEC.cluster.{name}: expected a list of 'host:port'")
        for a in addresses:
            _host_port(a, f"cluster.{name}")
        pools[idx] = list(addresses)
    if len(pools.get(0, [])) != 1:
        raise ValueError(
            f"CLUSTER_SPEC.cluster.workerpool0: the primary pool needs exactly 1 replica, got {len(pools.get(0, []))}"
        )
    ttype, index = task.get("type"), task.get("index")
    if not isinstance(ttype, str) or not ttype.startswith("workerpool") or not ttype[10:].isdigit():
        raise ValueError(f"CLUSTER_SPEC.task.type: expected 'workerpool<N>', got {ttype!r}")
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"CLUSTER_SPEC.task.index: expected an integer, got {index!r}")
    pool = int(ttype[10:])
    if pool not in pools or not 0 <= index < len(pools[pool]):
        raise ValueError(f"CLUSTER_SPEC.task: {ttype}[{index}] is not in the cluster")
    return ClusterSpec(pools, pool, index, str(spec.get("environment", "cloud")))


@dataclass(frozen=True)
class Placement:
    """What one replica runs and where its peers are (from ``placement``)."""

    role: str
    rank: int = -1
    """DDP rank (NN roles), -1 for a parameter server."""
    world_size: int = 1
    """NN workers (DDP ranks) in the job."""
    master_addr: str = ""
    master_port: int = 0
    ps_addresses: list[str] = field(default_factory=list)
    """``host:port`` of shard 0..N-1."""
    shards: list[int] = field(default_factory=list)
    """Parameter server: the shards this replica serves."""
    ports: list[int] = field(default_factory=list)
    """Parameter server: the port of each of ``shards``."""
    local_ranks: int = 1
    """NN roles: worker processes (DDP ranks ``rank .. rank + local_ranks - 1``) on this replica."""

    def env(self, local_rank: int = 0) -> dict[str, str]:
        """torch.distributed and persia environment of one NN worker process of this replica (``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``PERSIA_PS_ADDRESSES``)."""
        if not 0 <= local_rank < self.local_ranks:
            raise ValueError(f"local_rank {local_rank} outside 0..{self.local_ranks - 1}")
        return {
            "RANK": str(self.rank + local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "PERSIA_PS_ADDRESSES": ",".join(self.ps_addresses),
        }


ENTRY_COMMAND = ["python", "-m", "persia_core.cluster"]
"""The container command of every pool (the role comes from CLUSTER_SPEC)."""


@dataclass(frozen=True)
class Machine:
    """A worker pool's machine (Vertex AI ``MachineSpec`` + ``DiskSpec``)."""

    machine_type: str
    accelerator_type: str = ""
    """e.g. ``NVIDIA_TESLA_A100``; empty: none."""
    accelerator_count: int = 0
    boot_disk_type: str = "pd-ssd"
    boot_disk_gb: int = 100

    def __post_init__(self) -> None:
        if not self.machine_type:
            raise ValueError("machine_type must not be empty")
        if bool(self.accelerator_type) != (self.accelerator_count > 0):
            raise ValueError(f"{self.machine_type}: give both accelerator_type and accelerator_count > 0, or neither")

    def machine_spec(self) -> dict:
        m = {"machineType": self.machine_type}
        if self.accelerator_type:
            m.update(acceleratorType=self.accelerator_type, acceleratorCount=self.accelerator_count)
        return m


def worker_pool_specs(
    nn_machine: Machine,
    ps_machine: Machine,
    nn_replicas: int,
    ps_replicas: int,
    image: str,
    args: list[str],
    env: dict[str, str] | None = None,
    nn_image: str = "",
) -> list[dict]:
    """``workerPoolSpecs`` of a CustomJob (Vertex AI REST shape) running ``ENTRY_COMMAND`` + ``args`` everywhere:

        [0] primary: 1 x nn_machine     [1] NN workers: nn_replicas - 1 x nn_machine ({} when none)
        [2] parameter servers: ps_replicas x ps_machine

    ``nn_image`` (default ``image``) runs pools 0 and 1, e.g. a CUDA build. Raises ``ValueError`` for fewer
    than one NN or parameter-server replica or an empty image."""
    if nn_replicas < 1 or ps_replicas < 1:
        raise ValueError(f"need >= 1 NN replica and >= 1 parameter-server replica, got {nn_replicas} and {ps_replicas}")
    if not image:
        raise ValueError("image must not be empty")
    env_list = [{"name": k, "value": str(v)} for k, v in sorted((env or {}).items())]

    def pool(machine: Machine, count: int, img: str) -> dict:
        container = {"imageUri": img, "command": list(ENTRY_COMMAND), "args": list(args)}
        if env_list:
            container["env"] = [dict(e) for e in env_list]
        return {
            "machineSpec": machine.machine_spec(),
            "replicaCount": count,
            "diskSpec": {"bootDiskType": machine.boot_disk_type, "bootDiskSizeGb": machine.boot_disk_gb},
            "containerSpec": container,
        }

    return [
        pool(nn_machine, 1, nn_image or image),
        pool(nn_machine, nn_replicas - 1, nn_image or image) if nn_replicas > 1 else {},
        pool(ps_machine, ps_replicas, image),
    ]


def ps_addresses(spec: ClusterSpec, shards_per_server: int = 1) -> list[str]:
    """``host:port`` of every shard: shard s on replica s // k of pool 2, port = its port + s % k."""
    out = []
    for address in spec.pools.get(2, []):
        host, port = _host_port(address, "cluster.workerpool2")
        out += [f"{host}:{port + j}" for j in range(shards_per_server)]
    return out


def placement(spec: ClusterSpec, shards_per_server: int = 1, ranks_per_replica: int = 1) -> Placement:
    """This replica's role, DDP ranks and world size, rendezvous address and the shard addresses.

    Raises ``ValueError`` when there is no parameter-server pool, or ``shards_per_server`` or
    ``ranks_per_replica`` is < 1."""
    if shards_per_server < 1:
        raise ValueError(f"shards_per_server must be >= 1, got {shards_per_server}")
    if ranks_per_replica < 1:
        raise ValueError(f"ranks_per_replica must be >= 1, got {ranks_per_replica}")
    if not spec.pools.get(2):
        raise ValueError("CLUSTER_SPEC.cluster.workerpool2: no parameter-server replicas (pool 2)")
    addresses = ps_addresses(spec, shards_per_server)
    master_addr, master_port = _host_port(spec.pools[0][0], "cluster.workerpool0")
    g = ranks_per_replica
    world = g * (1 + len(spec.pools.get(1, [])))
    common = dict(world_size=world, master_addr=master_addr, master_port=master_port, ps_addresses=addresses)
    if spec.pool == 0:
        return Placement(PRIMARY, rank=0, local_ranks=g, **common)
    if spec.pool == 1:
        return Placement(NN_WORKER, rank=g * (1 + spec.index), local_ranks=g, **common)
    _, port = _host_port(spec.pools[2][spec.index], "cluster.workerpool2")
    shards = list(range(spec.index * shards_per_server, (spec.index + 1) * shards_per_server))
    return Placement(PARAMETER_SERVER, shards=shards, ports=[port + j for j in range(shards_per_server)], **common)


def resolve_token(environ: dict | None = None) -> str:
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
    from persia_core.ps.client import EmbeddingClient, ParameterServerError

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


def finalize_model(
    config, data_dir: str, model_dir: str, addresses: list[str], token: str, wall_seconds: float
) -> dict:
    """After the last step: every server dumps its shard into ``model_dir``; the manifest is written last, by the
    same writer as a local run's (``persia_core.train.model_output.finish_model``): shard CRC-32Cs and lineage
    included. Returns the manifest."""
    from persia_core.checkpoints import lineage
    from persia_core.data.reader import read_schema
    from persia_core.ps.client import EmbeddingClient
    from persia_core.train.model_output import finish_model

    n = len(addresses)
    client = EmbeddingClient(addresses, config.embedding, token=token)
    try:
        dumped = client.dump([io.join(model_dir, shard_file_name(s)) for s in range(n)])
        stats = client.stats()
    finally:
        client.close()
    return finish_model(
        model_dir, config, read_schema(data_dir), dumped, stats, wall_seconds, lineage(config, data_dir)
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
    from persia_core import checkpoints as ckpt

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
    manifest = finalize_model(config, args.data, args.out, place.ps_addresses, token, time.time() - t0)
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
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "persia_core.train.worker", *worker_args], env=env, preexec_fn=die_with_parent
            )
        )
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
    from_ckpt = {}
    if resume is not None:
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
                io.join(resume[0], e["path"]),
                "--init-size",
                str(e["bytes"]),
                "--init-crc32c",
                str(e["crc32c"]),
            ]
        elif init and io.exists(init):
            cmd += ["--init", init]
        log.info("parameter server: shard %d/%d on %s:%d", shard, n, args.host, port)
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent))
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
    from persia_core.config import load_config

    spec = parse_cluster_spec(cluster_spec)
    place = placement(spec, args.shards_per_server, args.ranks_per_replica)
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
    p.add_argument("--host", default="0.0.0.0", help="address parameter servers bind")
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
    sys.exit(main())
