"""The worker-pool layout of a Vertex AI CustomJob: the pools a job is submitted with (``worker_pool_specs``) and
where one replica stands in them, read back from ``CLUSTER_SPEC`` (``parse_cluster_spec``, ``placement``).

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
    pool 3  embedding workers  optional, CPU machines: replica i runs embedding workers i*e .. i*e+e-1
                               (e = --embedding-workers-per-replica) on ports p .. p+e-1, bound on 0.0.0.0;
                               embedding worker j serves NN worker (DDP rank) j // E as its embedding worker
                               j % E, E = --embedding-workers per NN worker (so len(pool 3) * e = WORLD_SIZE * E).
                               Without pool 3 every NN worker runs its E embedding workers on its own machine.

So WORLD_SIZE = 1 + len(workerpool1), RANK as above, MASTER_ADDR:MASTER_PORT = workerpool0[0], and the
parameter-server address of shard s is ``host(workerpool2[s // k]):(port + s % k)``. With g ranks per replica
(``--ranks-per-replica``, e.g. one per GPU of an 8-GPU machine) every NN replica runs g worker processes:
replica j of the NN replicas (primary first) holds ranks j*g .. j*g+g-1 (``LOCAL_RANK`` 0..g-1) and
WORLD_SIZE = g * (1 + len(workerpool1)).

The replica entry point that runs a role is ``persia_core.cluster``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from persia_core.ps.protocol import EW_ADDRESSES_ENV

PRIMARY, NN_WORKER, PARAMETER_SERVER, EMBEDDING_WORKER = "primary", "nn_worker", "parameter_server", "embedding_worker"
DEVICE_ENV = "PERSIA_NN_DEVICE"
"""Set to ``cuda`` in a replica or pod that was given GPUs: its NN workers then refuse to train on the CPU (their
``trainer.device`` ``auto`` would fall back to it silently when the GPU driver is missing)."""
POOL_ROLES = {0: PRIMARY, 1: NN_WORKER, 2: PARAMETER_SERVER, 3: EMBEDDING_WORKER}
"""Worker-pool index -> role."""


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
    ``workerpool0..3``, pool 0 without exactly one replica, a task outside the cluster, an address without a
    port."""
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
                f"CLUSTER_SPEC.cluster.{name}: pool {idx} has no role here (pools 0, 1, 2, 3: primary, "
                f"NN workers, parameter servers, embedding workers)"
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
    ew_addresses: list[str] = field(default_factory=list)
    """``host:port`` of every embedding worker of pool 3 (empty: they run beside their NN workers)."""
    embedding_workers: int = 0
    """E: embedding workers per NN worker in pool 3 (0: no pool 3)."""

    def rank_ew_addresses(self, rank: int) -> list[str]:
        """The pool-3 embedding workers of NN worker ``rank`` (empty without pool 3)."""
        e = self.embedding_workers
        return self.ew_addresses[rank * e : (rank + 1) * e]

    def env(self, local_rank: int = 0) -> dict[str, str]:
        """torch.distributed and persia environment of one NN worker process of this replica (``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (its NN workers share the replica's cores among their
        embedding workers), ``MASTER_ADDR``, ``MASTER_PORT``, ``PERSIA_PS_ADDRESSES``, and with pool 3
        ``PERSIA_EMBEDDING_WORKER_ADDRESSES``: its own embedding workers)."""
        if not 0 <= local_rank < self.local_ranks:
            raise ValueError(f"local_rank {local_rank} outside 0..{self.local_ranks - 1}")
        ews = self.rank_ew_addresses(self.rank + local_rank)
        return ({EW_ADDRESSES_ENV: ",".join(ews)} if ews else {}) | {
            "RANK": str(self.rank + local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_ranks),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "PERSIA_PS_ADDRESSES": ",".join(self.ps_addresses),
        }


ENTRY_COMMAND = ["python", "-m", "persia_core.cluster"]
"""The container command of every pool (the role comes from CLUSTER_SPEC)."""
GPU_ONLY_FAMILIES = ("a2-", "a3-", "a4-", "g2-")
"""Machine families that exist only with their GPUs attached (Vertex AI and GKE refuse them without one)."""
CPU_NN_MACHINE_TYPE = "n2-standard-16"
"""The NN workers' machine where they run without GPUs."""
PS_PROCESS_OVERHEAD_BYTES = 512 << 20
"""Bytes one parameter-server shard process holds beyond its table's budget (interpreter, gRPC buffers)."""
PS_POD_OVERHEAD_BYTES = 512 << 20
"""Bytes of a parameter-server replica's own entry process (``persia_core.cluster``, which starts the shards)."""

GPU_MACHINE_FAMILIES = (
    ("NVIDIA_TESLA_A100", "a2-"),
    ("NVIDIA_A100_80GB", "a2-"),
    ("NVIDIA_H100", "a3-"),
    ("NVIDIA_H200", "a3-"),
    ("NVIDIA_L4", "g2-"),
    ("NVIDIA_TESLA_T4", "n1-"),
    ("NVIDIA_TESLA_V100", "n1-"),
    ("NVIDIA_TESLA_P100", "n1-"),
    ("NVIDIA_TESLA_P4", "n1-"),
    ("NVIDIA_B200", "a4-"),
)
"""GPU type prefix -> the Compute Engine machine family that carries it (Vertex AI refuses other pairs)."""


def nn_machine_problem(accelerator_type: str, machine_type: str, gpus: int, count_name: str = "gpus") -> str:
    """Why Vertex AI would refuse an NN machine ``machine_type`` with ``gpus`` GPUs of ``accelerator_type`` (Vertex
    AI's name; '' for CPU-only), or '' where it can carry them: an unknown GPU, a GPU on a machine family that
    does not carry it, a GPU count (named ``count_name`` in the reason) other than the machine's fixed one
    (``a2-highgpu-2g``: 2)."""
    known = [prefix for prefix, _ in GPU_MACHINE_FAMILIES]
    if not accelerator_type:
        return ""
    if not accelerator_type.startswith(tuple(known)):
        return f"{accelerator_type!r} is not a GPU this project knows: {known}"
    family = next(f for prefix, f in GPU_MACHINE_FAMILIES if accelerator_type.startswith(prefix))
    if not machine_type.startswith(family):
        return f"{accelerator_type} GPUs come only on {family}* machines, not {machine_type!r}"
    fixed = re.search(r"-(\d+)g$", machine_type)
    if fixed and int(fixed.group(1)) != gpus:
        return f"{machine_type} carries {fixed.group(1)} GPU(s), not {count_name}={gpus}"
    return ""


def ps_pod_memory_bytes(shards: int, shard_memory_bytes: int) -> int:
    """Memory of a parameter-server replica (a Kubernetes pod) of ``shards`` shard processes, each with a table
    budget of ``shard_memory_bytes`` (``embedding.shard_memory_bytes``): what the Kubeflow target's JobSet asks
    for and the capacity planner checks against the machine."""
    return shards * (shard_memory_bytes + PS_PROCESS_OVERHEAD_BYTES) + PS_POD_OVERHEAD_BYTES


PATH_PLACEHOLDERS = ("dataset", "shards", "model", "control")
"""``{{name}}`` placeholders of ``replica_args``, filled with a run's folders when the job is submitted."""


def replica_args(
    shards_per_server: int = 1,
    ranks_per_replica: int = 1,
    embedding_workers: int = 0,
    embedding_workers_per_replica: int = 1,
) -> list[str]:
    """The arguments of ``ENTRY_COMMAND`` in every replica of a job (Vertex AI pools or Kubernetes pods), with
    ``{{dataset}}``, ``{{shards}}``, ``{{model}}`` and ``{{control}}`` placeholders for the run's folders."""
    args = ["--config", "{{shards}}/run_config.yaml", "--data", "{{dataset}}", "--init", "{{shards}}"]
    args += ["--out", "{{model}}", "--control", "{{control}}"]
    args += ["--shards-per-server", str(shards_per_server), "--ranks-per-replica", str(ranks_per_replica)]
    if embedding_workers:
        args += ["--embedding-workers", str(embedding_workers)]
        args += ["--embedding-workers-per-replica", str(embedding_workers_per_replica)]
    return args


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
        m: dict[str, str | int] = {"machineType": self.machine_type}
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
    ew_machine: Machine | None = None,
    ew_replicas: int = 0,
) -> list[dict]:
    """``workerPoolSpecs`` of a CustomJob (Vertex AI REST shape) running ``ENTRY_COMMAND`` + ``args`` everywhere:

        [0] primary: 1 x nn_machine     [1] NN workers: nn_replicas - 1 x nn_machine ({} when none)
        [2] parameter servers: ps_replicas x ps_machine
        [3] embedding workers: ew_replicas x ew_machine (only when ew_replicas > 0)

    ``nn_image`` (default ``image``) runs pools 0 and 1, e.g. a CUDA build. Raises ``ValueError`` for fewer
    than one NN or parameter-server replica or an empty image."""
    if nn_replicas < 1 or ps_replicas < 1:
        raise ValueError(f"need >= 1 NN replica and >= 1 parameter-server replica, got {nn_replicas} and {ps_replicas}")
    if not image:
        raise ValueError("image must not be empty")
    env_list = [{"name": k, "value": str(v)} for k, v in sorted((env or {}).items())]

    def pool(machine: Machine, count: int, img: str) -> dict:
        container: dict[str, Any] = {"imageUri": img, "command": list(ENTRY_COMMAND), "args": list(args)}
        if env_list:
            container["env"] = [dict(e) for e in env_list]
        return {
            "machineSpec": machine.machine_spec(),
            "replicaCount": count,
            "diskSpec": {"bootDiskType": machine.boot_disk_type, "bootDiskSizeGb": machine.boot_disk_gb},
            "containerSpec": container,
        }

    specs = [
        pool(nn_machine, 1, nn_image or image),
        pool(nn_machine, nn_replicas - 1, nn_image or image) if nn_replicas > 1 else {},
        pool(ps_machine, ps_replicas, image),
    ]
    if ew_replicas > 0:
        if ew_machine is None:
            raise ValueError("an embedding-worker pool needs its machine (ew_machine)")
        specs.append(pool(ew_machine, ew_replicas, image))
    return specs


def ps_addresses(spec: ClusterSpec, shards_per_server: int = 1) -> list[str]:
    """``host:port`` of every shard: shard s on replica s // k of pool 2, port = its port + s % k."""
    out = []
    for address in spec.pools.get(2, []):
        host, port = _host_port(address, "cluster.workerpool2")
        out += [f"{host}:{port + j}" for j in range(shards_per_server)]
    return out


def ew_addresses(spec: ClusterSpec, per_replica: int = 1) -> list[str]:
    """``host:port`` of every embedding worker: j on replica j // e of pool 3, port = its port + j % e."""
    out = []
    for address in spec.pools.get(3, []):
        host, port = _host_port(address, "cluster.workerpool3")
        out += [f"{host}:{port + j}" for j in range(per_replica)]
    return out


def placement(
    spec: ClusterSpec,
    shards_per_server: int = 1,
    ranks_per_replica: int = 1,
    embedding_workers: int = 0,
    embedding_workers_per_replica: int = 1,
) -> Placement:
    """This replica's role, DDP ranks and world size, rendezvous address, the shard addresses, and with pool 3
    the embedding workers' (``embedding_workers`` E per NN worker, ``embedding_workers_per_replica`` per replica).

    Raises ``ValueError`` when there is no parameter-server pool, ``shards_per_server``, ``ranks_per_replica`` or
    ``embedding_workers_per_replica`` is < 1, or pool 3 does not hold E embedding workers for each NN worker."""
    for name, v in (
        ("shards_per_server", shards_per_server),
        ("ranks_per_replica", ranks_per_replica),
        ("embedding_workers_per_replica", embedding_workers_per_replica),
    ):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not spec.pools.get(2):
        raise ValueError("CLUSTER_SPEC.cluster.workerpool2: no parameter-server replicas (pool 2)")
    addresses = ps_addresses(spec, shards_per_server)
    master_addr, master_port = _host_port(spec.pools[0][0], "cluster.workerpool0")
    g = ranks_per_replica
    world = g * (1 + len(spec.pools.get(1, [])))
    ews = ew_addresses(spec, embedding_workers_per_replica)
    if ews and (embedding_workers < 1 or len(ews) != world * embedding_workers):
        raise ValueError(
            f"CLUSTER_SPEC.cluster.workerpool3: {len(spec.pools[3])} replicas x {embedding_workers_per_replica} "
            f"embedding workers each = {len(ews)}, but {world} NN workers x --embedding-workers "
            f"{embedding_workers} need {world * embedding_workers}"
        )
    common: dict[str, Any] = dict(
        world_size=world,
        master_addr=master_addr,
        master_port=master_port,
        ps_addresses=addresses,
        ew_addresses=ews,
        embedding_workers=embedding_workers if ews else 0,
    )
    if spec.pool == 0:
        return Placement(PRIMARY, rank=0, local_ranks=g, **common)
    if spec.pool == 1:
        return Placement(NN_WORKER, rank=g * (1 + spec.index), local_ranks=g, **common)
    if spec.pool == 3:
        _, port = _host_port(spec.pools[3][spec.index], "cluster.workerpool3")
        k = embedding_workers_per_replica
        return Placement(EMBEDDING_WORKER, ports=[port + j for j in range(k)], **common)
    _, port = _host_port(spec.pools[2][spec.index], "cluster.workerpool2")
    shards = list(range(spec.index * shards_per_server, (spec.index + 1) * shards_per_server))
    return Placement(PARAMETER_SERVER, shards=shards, ports=[port + j for j in range(shards_per_server)], **common)
