"""Capacity plan computation: from the model and a target throughput to parameter servers, NN-worker GPUs,
network bytes per step and the Vertex AI worker pools to submit, or the GKE node pools of the same machines
(``plan(PlanInputs(...))``; the CLI and the printed table are ``persia_core.planner``'s).

Memory (parameter servers). Bytes per row come from the table's own accounting (``persia_core.memory``, what
``persia_core.embedding.table`` allocates): key, LRU links, last-used step and optimizer state from
``row_bytes_without_index``, the weights at the storage precision (``weights``; the table stores fp32 today,
fp16 is what the plan assumes), and the hash index of int32 slots at load <= ``memory.MAX_LOAD``, sized as
``memory.capacity_and_slots`` sizes it. One shard process holds at most 2^31 - 1 rows (its row numbers are
int32), so a large server runs several shard processes, each with an equal share of the server's usable RAM less
a fixed per-process overhead. Hash routing spreads rows evenly; each shard keeps 4 standard deviations of
headroom.

Compute (NN workers): GPUs = ceil(target samples/s / samples/s per GPU), on VMs of ``gpus_per_vm``.

Compute (embedding workers, CPU): cores = ceil(target samples/s x CPU seconds per sample / ``EW_BUSY``), the
CPU cost per sample measured by ``make bench-feed`` (``embedding_worker_cpu_us_per_sample``, at its 26 IDs per
sample) and scaled by ``ids_per_sample / 26``; as pool 3 of the CustomJob, E = ceil(cores / GPUs) processes per
NN worker, one per core, split over equal VMs of at most ``ew_cores_per_vm``.

Kubeflow (GKE): the same machines as node pools, one pod of each role per node (``gke_node_pools``), and the
``PERSIA_K8S_*`` settings that fill them (``kubeflow_settings``). A pod's requests fit its node: CPU = vCPUs - 1
(at least 1), memory = 90% of the machine's memory - 1 GiB, whole GiB (``pod_fit``). GKE keeps part of each node
for itself (about 3.6 GiB of a 32 GiB node, 2% of memory above 128 GiB, a few hundred millicores), and the system
DaemonSets and the Cloud Storage FUSE sidecar of every pod (250m, 256Mi) request a little more: one vCPU and 10%
+ 1 GiB cover them. The machine's vCPUs and memory come from its type (``machine_shape``: the vCPUs in the name,
the memory per vCPU of its family, or a table of fixed shapes); for a type not in it those settings stay absent.
An NN pod's memory limit is ``PERSIA_K8S_NN_MEMORY`` + ``PERSIA_K8S_SHM_SIZE`` (the memory-backed /dev/shm), so
the two share the fit; a parameter-server pod's memory follows the run's shard plan (k x the shard budget plus
overheads), which the plan checks against its machine.

Network per NN worker (one GPU, one DDP rank) per step: the batch's IDs, deduplicated (``unique_fraction``),
go out as uint64 (8 B) and come back as float32 rows (4 D B; the wire carries fp32 whatever the storage); the
gradient push sends both again; the dense all-reduce (ring) moves 2 (W - 1) / W x 4 B per dense parameter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from persia_core import memory as M
from persia_core.cluster_spec import (
    CPU_NN_MACHINE_TYPE,
    GPU_ONLY_FAMILIES,
    Machine,
    nn_machine_problem,
    worker_pool_specs,
)
from persia_core.cluster_spec import ps_pod_memory_bytes as ps_pod_memory
from persia_core.config import OPTIMIZERS

WEIGHT_BYTES = {k: v for k, v in M.STORAGE_BYTES.items()}
MAX_ROWS_PER_SHARD = int(np.iinfo(np.int32).max)
"""Rows one shard process can hold: the table's row numbers (index slots, recency queue) are int32."""
INDEX_SLOT_BYTES = 4
"""One int32 slot of the table's hash index."""
TB = 10**12
SKEW_SIGMAS = 4.0
EW_BUSY = 0.8
"""Share of an embedding-worker core the plan fills (the rest absorbs skew and the servers' slow moments)."""
GIB = 1 << 30
BENCH_FEED_IDS_PER_SAMPLE = 26.0
"""IDs per sample of ``make bench-feed``'s Criteo-shaped set, at which ``ew_cpu_us_per_sample`` is measured."""
GPU_NN_MACHINE_TYPE = "a2-highgpu-8g"
"""The NN workers' default machines: with a GPU (8 x A100), and CPU-only (as the Vertex AI target's)."""


@dataclass
class RowBytes:
    """Bytes per row, everything included, split as the table stores it."""

    key: int
    lru: int
    """The recency queue: 1.25 (row, step) entries of 8 B per row (its fixed 8 KiB is amortized in ``index``)."""
    last_used: int
    weights: int
    optimizer_state: int
    index: float
    """Hash-index slots per row at the planned capacity (4 B per slot, load <= MAX_LOAD), and the recency
    queue's fixed 8 KiB, amortized over the rows."""

    @property
    def total(self) -> float:
        return self.key + self.lru + self.last_used + self.weights + self.optimizer_state + self.index

    @property
    def without_index(self) -> int:
        return self.key + self.lru + self.last_used + self.weights + self.optimizer_state


def row_bytes_without_index(optimizer: str, dim: int, weights: str = "fp32") -> int:
    """Bytes per row excluding the hash index, at weight precision ``weights`` (``fp32`` | ``fp16`` | ``bf16``):
    the table's own accounting (``memory.row_bytes_without_index``)."""
    if weights not in WEIGHT_BYTES:
        raise ValueError(f"weights must be one of {sorted(WEIGHT_BYTES)}, got {weights!r}")
    return M.row_bytes_without_index(optimizer, dim, weights)


def row_bytes(optimizer: str, dim: int, weights: str, capacity: int, slots: int) -> RowBytes:
    """The per-row breakdown at ``capacity`` rows over ``slots`` index slots."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    state = M.state_bytes(optimizer, dim)
    fixed = M.row_bytes_without_index(optimizer, dim) - 4 * dim - state  # key + recency queue + last-used step
    return RowBytes(
        key=8,
        lru=fixed - 12,
        last_used=4,
        weights=WEIGHT_BYTES[weights] * dim,
        optimizer_state=state,
        index=(INDEX_SLOT_BYTES * slots + M.QUEUE_FIXED_BYTES) / max(capacity, 1),
    )


@dataclass
class PlanInputs:
    """What the plan is computed from (the CLI's arguments)."""

    rows: int
    """Embedding rows = distinct feature IDs (= parameters / dim)."""
    dim: int = 32
    weights: str = "fp32"
    optimizer: str = "rowwise_adagrad"
    vm_ram_tb: float = 12.0
    """RAM of one parameter-server VM, in TB (10^12 bytes)."""
    usable: float = 0.9
    """Share of a server's RAM the shard processes may use."""
    process_overhead_gb: float = 0.5
    """Memory of one shard process besides its table (interpreter, gRPC buffers), GB (10^9 bytes)."""
    batch_size: int = 512
    """Samples per NN worker (GPU) per step."""
    throughput: float = 1.0e6
    """Target samples per second, whole job."""
    samples_per_gpu: float = 50_000.0
    """Samples per second one NN worker (GPU) sustains (measure it; an assumption here)."""
    gpus_per_vm: int = 8
    ids_per_sample: float = 26.0
    """Feature IDs per sample over all slots."""
    unique_fraction: float = 1.0
    """Share of a batch's IDs left after deduplication (1 = no repeats, the worst case)."""
    dense_params: float = 1.0e6
    """Parameters of the dense network (all-reduced every step)."""
    nic_gbps: float = 100.0
    """Network bandwidth of one parameter-server VM, Gbit/s."""
    ew_cpu_us_per_sample: float = 3.4
    """Embedding-worker CPU microseconds per sample at 26 IDs per sample (``make bench-feed``'s
    ``embedding_worker_cpu_us_per_sample``; 3.4, the median of three runs on a 2-core cloud VM)."""
    ew_cores_per_vm: int = 32
    ew_machine_type: str = "n2-highcpu-32"
    ps_machine_type: str = "m2-ultramem-416"
    gpu_machine_type: str = ""
    """NN-worker machine (default ``GPU_NN_MACHINE_TYPE`` with a GPU, ``CPU_NN_MACHINE_TYPE`` CPU-only)."""
    accelerator_type: str = "NVIDIA_TESLA_A100"
    """GPU of an NN-worker machine, Vertex AI's name (gcloud's ``nvidia-tesla-a100`` accepted); ``none`` or
    empty: CPU-only NN workers (``gpus_per_vm`` is then their processes per machine)."""
    image: str = "IMAGE_URI"

    def __post_init__(self) -> None:
        checks = {
            "rows": (self.rows >= 1, ">= 1"),
            "dim": (self.dim >= 1, ">= 1"),
            "vm_ram_tb": (self.vm_ram_tb > 0, "> 0"),
            "usable": (0 < self.usable <= 1, "in (0, 1]"),
            "process_overhead_gb": (self.process_overhead_gb >= 0, ">= 0"),
            "batch_size": (self.batch_size >= 1, ">= 1"),
            "throughput": (self.throughput > 0, "> 0"),
            "samples_per_gpu": (self.samples_per_gpu > 0, "> 0"),
            "gpus_per_vm": (self.gpus_per_vm >= 1, ">= 1"),
            "ids_per_sample": (self.ids_per_sample > 0, "> 0"),
            "unique_fraction": (0 < self.unique_fraction <= 1, "in (0, 1]"),
            "dense_params": (self.dense_params >= 0, ">= 0"),
            "nic_gbps": (self.nic_gbps > 0, "> 0"),
            "ew_cpu_us_per_sample": (self.ew_cpu_us_per_sample > 0, "> 0"),
            "ew_cores_per_vm": (self.ew_cores_per_vm >= 1, ">= 1"),
        }
        for name, (ok, need) in checks.items():
            value = getattr(self, name)
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                flag = "" if name == "rows" else f" (--{name.replace('_', '-')})"
                raise ValueError(f"planner: invalid {name}={value!r}{flag}: must be a finite number {need}")
        if self.weights not in WEIGHT_BYTES:
            raise ValueError(f"planner: weights must be one of {sorted(WEIGHT_BYTES)}, got {self.weights!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"planner: optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        accel = self.accelerator_type.strip()
        # "none" (as PERSIA_ACCELERATOR_TYPE=none on Vertex AI): CPU-only NN workers; gcloud's spelling accepted
        self.accelerator_type = "" if accel.lower() in ("", "none") else accel.upper().replace("-", "_")
        if not self.gpu_machine_type:
            self.gpu_machine_type = GPU_NN_MACHINE_TYPE if self.accelerator_type else CPU_NN_MACHINE_TYPE
            if self.accelerator_type == "NVIDIA_TESLA_A100" and self.gpus_per_vm in (1, 2, 4):
                self.gpu_machine_type = f"a2-highgpu-{self.gpus_per_vm}g"  # the A100 machine of that GPU count
        if not self.accelerator_type and self.gpu_machine_type.startswith(GPU_ONLY_FAMILIES):
            raise ValueError(
                f"planner: --gpu-machine-type {self.gpu_machine_type} carries GPUs, but --accelerator-type is "
                f"none (CPU-only NN workers): name its GPU, or a CPU machine such as {CPU_NN_MACHINE_TYPE}"
            )
        why = nn_machine_problem(self.accelerator_type, self.gpu_machine_type, self.gpus_per_vm, "--gpus-per-vm")
        if why:  # the worker-pool specs it writes would be refused by Vertex AI (and by make compile)
            raise ValueError(f"planner: --accelerator-type / --gpu-machine-type: {why}")


@dataclass
class Plan:
    inputs: PlanInputs
    row_bytes: RowBytes
    shards_per_server: int
    rows_per_shard_capacity: int
    shard_budget_bytes: int
    parameter_servers: int
    total_shards: int
    rows_per_shard: float
    memory_per_server_bytes: float
    gpus: int
    nn_vms: int
    embedding_worker_cores: int
    embedding_worker_vms: int
    embedding_workers_per_nn_worker: int
    steps_per_s: float
    net_lookup_bytes_per_step: float
    net_push_bytes_per_step: float
    net_allreduce_bytes_per_step: float
    ps_gbps_per_server: float
    worker_pool_specs: list[dict] = field(default_factory=list)
    gke_node_pools: list[dict] = field(default_factory=list)
    """The same machines as GKE node pools, one per role (``gke_node_pools``)."""
    kubeflow_settings: dict[str, int | str | None] = field(default_factory=dict)
    """The ``PERSIA_K8S_*`` compile settings that lay the roles out on those pools, one pod per node, with the
    pods' resources (``kubeflow_resources``; None where the machine's shape is unknown)."""
    pipeline_parameters: dict[str, int] = field(default_factory=dict)
    """The pipeline parameters the run must use so that the counts divide by those settings:
    ``num_parameter_servers`` (= total shards) and ``num_nn_workers`` (= NN workers, one per GPU)."""
    ps_pod_memory_bytes: float = 0.0
    """A parameter-server pod's memory on Kubeflow with ``embedding.shard_memory_bytes`` at the shard budget: what
    the JobSet asks for (``cluster_spec.ps_pod_memory_bytes``)."""
    kubeflow_notes: list[str] = field(default_factory=list)
    """What the Kubeflow settings could not derive (a machine type of unknown shape), or what does not fit."""

    @property
    def net_bytes_per_step(self) -> float:
        return self.net_lookup_bytes_per_step + self.net_push_bytes_per_step + self.net_allreduce_bytes_per_step


GKE_ACCELERATORS = {
    "NVIDIA_TESLA_A100": "nvidia-tesla-a100",
    "NVIDIA_A100_80GB": "nvidia-a100-80gb",
    "NVIDIA_H100": "nvidia-h100-80gb",
    "NVIDIA_H100_80GB": "nvidia-h100-80gb",
    "NVIDIA_H100_MEGA_80GB": "nvidia-h100-mega-80gb",
    "NVIDIA_H200": "nvidia-h200-141gb",
    "NVIDIA_H200_141GB": "nvidia-h200-141gb",
    "NVIDIA_L4": "nvidia-l4",
    "NVIDIA_TESLA_T4": "nvidia-tesla-t4",
    "NVIDIA_TESLA_V100": "nvidia-tesla-v100",
    "NVIDIA_B200": "nvidia-b200",
}
"""Vertex AI's accelerator names -> GKE's (``gcloud container node-pools create --accelerator type=...``)."""
MACHINE_GB_PER_VCPU: dict[str, float] = {
    "n2-standard": 4,
    "n2-highmem": 8,
    "n2-highcpu": 1,
    "n2d-standard": 4,
    "n2d-highmem": 8,
    "n2d-highcpu": 1,
    "e2-standard": 4,
    "e2-highmem": 8,
    "e2-highcpu": 1,
    "c2-standard": 4,
    "c2d-standard": 4,
    "c2d-highmem": 8,
    "c2d-highcpu": 2,
    "c3-standard": 4,
    "c3-highmem": 8,
    "c3-highcpu": 2,
    "n1-standard": 3.75,
    "n1-highmem": 6.5,
    "n1-highcpu": 0.9,
    "g2-standard": 4,
}
"""Compute Engine families ``<series>-<kind>-<vCPUs>`` -> memory per vCPU, GB (Compute Engine's GB are GiB:
n2-highcpu-32 has 32 GB = 32768 MB)."""
GPU_MACHINE_PER_GPU: dict[str, tuple[int, float]] = {
    "a2-highgpu": (12, 85),
    "a2-ultragpu": (12, 170),
    "a3-highgpu": (26, 234),
}
"""GPU families ``<series>-<kind>-<GPUs>g`` -> (vCPUs, GB) per GPU (a3-highgpu-8g: 208 vCPUs, 1872 GB)."""
MACHINE_SHAPES: dict[str, tuple[int, float]] = {
    "m1-megamem-96": (96, 1433.6),
    "m1-ultramem-40": (40, 961),
    "m1-ultramem-80": (80, 1922),
    "m1-ultramem-160": (160, 3844),
    "m2-megamem-416": (416, 5888),
    "m2-ultramem-208": (208, 5888),
    "m2-ultramem-416": (416, 11776),
    "m2-hypermem-416": (416, 8832),
    "m3-megamem-64": (64, 976),
    "m3-megamem-128": (128, 1952),
    "m3-ultramem-32": (32, 976),
    "m3-ultramem-64": (64, 1952),
    "m3-ultramem-128": (128, 3904),
    "a2-megagpu-16g": (96, 1360),
    "a3-megagpu-8g": (208, 1872),
    "a3-ultragpu-8g": (224, 2952),
}
"""Machines of fixed shape (memory-optimized, the larger GPU types) -> (vCPUs, GB)."""


def machine_shape(machine_type: str) -> tuple[int, float] | None:
    """``(vCPUs, memory GB)`` of a Compute Engine machine type (GB as Compute Engine counts them, 2^30 bytes):
    from ``MACHINE_SHAPES``, else the GPU count or vCPUs in the name times ``GPU_MACHINE_PER_GPU`` or
    ``MACHINE_GB_PER_VCPU``; None for a type it does not know (shared-core, custom, -lssd, other families)."""
    if machine_type in MACHINE_SHAPES:
        return MACHINE_SHAPES[machine_type]
    m = re.fullmatch(r"([a-z][a-z0-9]*-[a-z]+)-(\d+)(g?)", machine_type)
    if not m or int(m.group(2)) < 1:
        return None
    family, n = m.group(1), int(m.group(2))
    if m.group(3):
        if family not in GPU_MACHINE_PER_GPU:
            return None
        vcpus, gb = GPU_MACHINE_PER_GPU[family]
        return vcpus * n, gb * n
    if family not in MACHINE_GB_PER_VCPU:
        return None
    return n, n * MACHINE_GB_PER_VCPU[family]


def pod_fit(machine_type: str) -> tuple[int, int] | None:
    """``(CPU, memory GiB)`` one pod may request on a node of ``machine_type`` beside what GKE and the system
    keep: vCPUs - 1 (at least 1) and 90% of the memory - 1 GiB, rounded down to whole GiB. None when the shape
    is unknown or leaves less than 1 GiB."""
    shape = machine_shape(machine_type)
    if shape is None:
        return None
    vcpus, gb = shape
    memory = math.floor(0.9 * gb - 1)
    return (max(1, vcpus - 1), memory) if memory >= 1 else None


def kubeflow_resources(
    nn_machine: str, ps_machine: str, ew_machine: str, ps_pod_bytes: float, shm_gib: int = 16
) -> tuple[dict[str, str | None], list[str]]:
    """The ``PERSIA_K8S_*`` resource settings of one pod per node of each machine (``pod_fit``), and notes.

    ``PERSIA_K8S_NN_CPU``, ``_NN_MEMORY`` and ``_SHM_SIZE`` (NN_MEMORY + SHM_SIZE = the fit: the NN pod's limit;
    /dev/shm is ``shm_gib``, at most a quarter of the fit), ``_PS_CPU``, ``_EW_CPU``, ``_EW_MEMORY``; None where the
    machine's shape is unknown, with a note naming them. ``ps_pod_bytes``: a parameter-server pod's memory under
    the shard plan, checked against its machine's fit."""
    out: dict[str, str | None] = {}
    notes: list[str] = []
    unknown: list[tuple[str, list[str]]] = []
    nn = pod_fit(nn_machine)
    if nn is not None and nn[1] >= 2:
        shm = max(1, min(shm_gib, nn[1] // 4))
        out.update(
            PERSIA_K8S_NN_CPU=str(nn[0]), PERSIA_K8S_NN_MEMORY=f"{nn[1] - shm}Gi", PERSIA_K8S_SHM_SIZE=f"{shm}Gi"
        )
    else:
        out.update(PERSIA_K8S_NN_CPU=None, PERSIA_K8S_NN_MEMORY=None, PERSIA_K8S_SHM_SIZE=None)
        unknown.append((nn_machine, ["PERSIA_K8S_NN_CPU", "PERSIA_K8S_NN_MEMORY", "PERSIA_K8S_SHM_SIZE"]))
    ps = pod_fit(ps_machine)
    out["PERSIA_K8S_PS_CPU"] = str(ps[0]) if ps else None
    if ps is None:
        unknown.append((ps_machine, ["PERSIA_K8S_PS_CPU"]))
        notes.append(
            f"a parameter-server pod needs about {ps_pod_bytes / GIB:,.0f} GiB (the shard plan): check that "
            f"{ps_machine} holds it"
        )
    elif ps_pod_bytes > ps[1] * GIB:
        notes.append(
            f"a parameter-server pod needs about {ps_pod_bytes / GIB:,.0f} GiB (the shard plan) but one "
            f"{ps_machine} node fits {ps[1]:,} GiB: lower --vm-ram-tb or --usable, or pick a larger machine"
        )
    ew = pod_fit(ew_machine)
    if ew is not None:
        out.update(PERSIA_K8S_EW_CPU=str(ew[0]), PERSIA_K8S_EW_MEMORY=f"{ew[1]}Gi")
    else:
        out.update(PERSIA_K8S_EW_CPU=None, PERSIA_K8S_EW_MEMORY=None)
        unknown.append((ew_machine, ["PERSIA_K8S_EW_CPU", "PERSIA_K8S_EW_MEMORY"]))
    for machine, names in unknown:
        notes.append(
            f"{', '.join(names)} not derived: the planner does not know {machine}'s vCPUs and memory; set them "
            f"to fit one pod per node (vCPUs - 1, 90% of memory - 1 GiB)"
        )
    return out, notes


def gke_node_pools(specs: list[dict]) -> list[dict]:
    """GKE node pools for the roles of ``worker_pool_specs`` (Vertex AI REST shape): ``[{"name", "role",
    "machine_type", "nodes", "accelerator", "accelerator_count"}]`` for the NN workers (pools 0 and 1 share
    one), the parameter servers and, where there is a pool 3, the embedding workers; one pod per node. The
    names are what ``PERSIA_K8S_*_NODE_POOL`` and ``docs/kubeflow-gke.md`` use; ``vcpus`` and ``memory_gb``:
    the machine's (``machine_shape``; None when unknown). A pool 0 without an accelerator (CPU-only NN workers)
    gives a node pool without one."""
    nn = specs[0]["machineSpec"]
    accel = nn.get("acceleratorType", "")
    out = [
        {
            "name": "persia-nn",
            "role": "nn-worker",
            "machine_type": nn["machineType"],
            "nodes": 1 + (specs[1]["replicaCount"] if specs[1] else 0),
            "accelerator": GKE_ACCELERATORS.get(accel, accel.lower().replace("_", "-")) if accel else "",
            "accelerator_count": nn.get("acceleratorCount", 0) if accel else 0,
        }
    ]
    for n, name, role in ((2, "persia-ps", "parameter-server"), (3, "persia-ew", "embedding-worker")):
        if len(specs) > n and specs[n]:
            m = specs[n]["machineSpec"]["machineType"]
            out.append(dict(name=name, role=role, machine_type=m, nodes=specs[n]["replicaCount"]))
            out[-1].update(accelerator="", accelerator_count=0)
    for pool in out:
        shape = machine_shape(pool["machine_type"])
        pool.update(vcpus=shape[0] if shape else None, memory_gb=shape[1] if shape else None)
    return out


def _layouts(inp: PlanInputs) -> list[tuple[int, int, int, int]]:
    """Candidate server layouts ``(k shard processes per server, rows per process, its budget, index slots)``:
    every k up to 8 past the first whose processes are no longer capped by int32 row numbers."""
    usable = inp.vm_ram_tb * TB * inp.usable
    overhead = inp.process_overhead_gb * 1e9
    out = []
    first_uncapped = None
    for k in range(1, 100_001):
        budget = int((usable - k * overhead) / k)
        if budget <= 0:
            break
        cap, slots = M.capacity_and_slots(budget, inp.optimizer, inp.dim, inp.weights, MAX_ROWS_PER_SHARD)
        if cap == 0:
            break
        out.append((k, cap, budget, slots))
        if cap < MAX_ROWS_PER_SHARD:  # more processes would only split the RAM further
            first_uncapped = k if first_uncapped is None else first_uncapped
            if k >= first_uncapped + 8:
                break
    if not out:
        raise ValueError(
            f"planner: a server of {inp.vm_ram_tb} TB x {inp.usable} usable holds no shard process "
            f"of at least 1024 rows"
        )
    return out


def servers_needed(rows: int, k: int, cap: int) -> int:
    """Servers of k shard processes of ``cap`` rows that hold ``rows`` with the routing headroom: the fewest
    servers, from ``ceil(rows / (k cap))`` up, whose mean rows per shard plus ``SKEW_SIGMAS`` standard deviations
    fit in ``cap``. Found by bisection (the test is monotone in the server count), so a huge ``rows`` takes
    as long as a small one."""

    def fits(servers: int) -> bool:
        mean = rows / (servers * k)
        return mean * (1 + SKEW_SIGMAS / math.sqrt(max(mean, 1.0))) <= cap

    lo = max(1, math.ceil(rows / (k * cap)))
    if fits(lo):
        return lo
    # mean + s sqrt(mean) <= cap  <=>  sqrt(mean) <= (sqrt(s^2 + 4 cap) - s) / 2: a close upper estimate
    best_mean = ((math.sqrt(SKEW_SIGMAS**2 + 4 * cap) - SKEW_SIGMAS) / 2) ** 2
    hi = max(lo + 1, math.ceil(rows / (k * best_mean)))
    while not fits(hi):
        hi += hi - lo  # float rounding left the estimate short: widen
    while hi - lo > 1:  # fits(hi), not fits(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def plan(inp: PlanInputs) -> Plan:
    """The capacity plan for ``inp`` (see module docstring): the fewest servers, then the fewest shard
    processes per server."""
    servers, k, cap, budget, slots = min(
        (servers_needed(inp.rows, k, cap), k, cap, budget, slots) for k, cap, budget, slots in _layouts(inp)
    )
    rb = row_bytes(inp.optimizer, inp.dim, inp.weights, cap, slots)
    total_shards = servers * k
    mean = inp.rows / total_shards
    gpus_needed = max(1, math.ceil(inp.throughput / inp.samples_per_gpu))
    nn_vms = math.ceil(gpus_needed / inp.gpus_per_vm)
    gpus = nn_vms * inp.gpus_per_vm  # whole VMs; one DDP rank per GPU
    steps_per_s = inp.throughput / (gpus * inp.batch_size)
    ew_cpu_s = inp.ew_cpu_us_per_sample * 1e-6 * inp.ids_per_sample / BENCH_FEED_IDS_PER_SAMPLE
    ew_cores = max(1, math.ceil(inp.throughput * ew_cpu_s / EW_BUSY))
    # pool 3: E embedding workers per NN worker (one process per core), spread over replicas of equal size
    ew_per_nn = math.ceil(ew_cores / gpus)
    ew_total = gpus * ew_per_nn
    ew_per_vm = max(d for d in range(1, min(ew_total, inp.ew_cores_per_vm) + 1) if ew_total % d == 0)
    ew_vms = ew_total // ew_per_vm
    unique = inp.batch_size * inp.ids_per_sample * inp.unique_fraction
    row_wire = 4 * inp.dim
    lookup = unique * (8 + row_wire)
    push = unique * (8 + row_wire)
    allreduce = 2 * (gpus - 1) / gpus * 4 * inp.dense_params if gpus > 1 else 0.0
    ps_gbps = (lookup + push) * gpus * steps_per_s * 8 / servers / 1e9
    accel = inp.accelerator_type  # "" for CPU-only NN workers
    specs = worker_pool_specs(
        nn_machine=Machine(inp.gpu_machine_type, accel, inp.gpus_per_vm if accel else 0),
        ps_machine=Machine(inp.ps_machine_type),
        nn_replicas=nn_vms,
        ps_replicas=servers,
        image=inp.image,
        args=[
            "--shards-per-server",
            str(k),
            "--ranks-per-replica",
            str(inp.gpus_per_vm),
            "--embedding-workers",
            str(ew_per_nn),
            "--embedding-workers-per-replica",
            str(ew_per_vm),
        ],
        ew_machine=Machine(inp.ew_machine_type),
        ew_replicas=ew_vms,
    )
    ps_pod_bytes = ps_pod_memory(k, budget)  # what the JobSet asks for at this shard budget
    resources, notes = kubeflow_resources(inp.gpu_machine_type, inp.ps_machine_type, inp.ew_machine_type, ps_pod_bytes)
    return Plan(
        inputs=inp,
        row_bytes=rb,
        shards_per_server=k,
        rows_per_shard_capacity=cap,
        shard_budget_bytes=budget,
        parameter_servers=servers,
        total_shards=total_shards,
        rows_per_shard=mean,
        memory_per_server_bytes=k * (cap * rb.without_index + INDEX_SLOT_BYTES * slots + inp.process_overhead_gb * 1e9),
        gpus=gpus,
        nn_vms=nn_vms,
        embedding_worker_cores=ew_cores,
        embedding_worker_vms=ew_vms,
        embedding_workers_per_nn_worker=ew_per_nn,
        steps_per_s=steps_per_s,
        net_lookup_bytes_per_step=lookup,
        net_push_bytes_per_step=push,
        net_allreduce_bytes_per_step=allreduce,
        ps_gbps_per_server=ps_gbps,
        worker_pool_specs=specs,
        gke_node_pools=gke_node_pools(specs),
        kubeflow_settings={
            "PERSIA_K8S_GPUS": inp.gpus_per_vm if accel else 0,
            "PERSIA_K8S_RANKS_PER_REPLICA": inp.gpus_per_vm,
            "PERSIA_K8S_SHARDS_PER_SERVER": k,
            "PERSIA_K8S_EMBEDDING_WORKERS": ew_per_nn,
            "PERSIA_K8S_EMBEDDING_WORKERS_PER_REPLICA": ew_per_vm,
            **resources,
        },
        # the train step refuses num_shards not a multiple of k, num_workers of g, or num_workers x E of e
        pipeline_parameters={"num_parameter_servers": total_shards, "num_nn_workers": gpus},
        ps_pod_memory_bytes=ps_pod_bytes,
        kubeflow_notes=notes,
    )
