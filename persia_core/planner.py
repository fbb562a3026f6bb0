"""Capacity planner: from the model and a target throughput to parameter servers, NN-worker GPUs, network bytes
per step and the Vertex AI worker pools to submit.

    python -m persia_core.planner --params 1e14 --dim 32 --weights fp16 --optimizer rowwise_adagrad \\
        --vm-ram-tb 12 --usable 0.9          (also: python -m persia_core plan ...)

Memory (parameter servers). Bytes per row come from the table's own accounting (``persia_core.memory``, what
``persia_core.embedding.table`` allocates): key, LRU links, last-used step and optimizer state from
``row_bytes_without_index``, the weights at the storage precision (``--weights``; the table stores fp32 today,
fp16 is what the plan assumes), and the hash index of int32 slots at load <= ``memory.MAX_LOAD``, sized as
``capacity_for_budget`` sizes it. One shard process holds at most 2^31 - 1 rows (its row numbers are int32), so
a large server runs several shard processes, each with an equal share of the server's usable RAM less a fixed
per-process overhead. Hash routing spreads rows evenly; each shard keeps 4 standard deviations of headroom.

Compute (NN workers): GPUs = ceil(target samples/s / samples/s per GPU), on VMs of ``--gpus-per-vm``.

Network per NN worker (one GPU, one DDP rank) per step: the batch's IDs, deduplicated (``--unique-fraction``),
go out as uint64 (8 B) and come back as float32 rows (4 D B; the wire carries fp32 whatever the storage); the
gradient push sends both again; the dense all-reduce (ring) moves 2 (W - 1) / W x 4 B per dense parameter.

The plan prints as a table whose last line is ``parameter_servers=N``; ``--json`` also writes it with the
worker-pool specs (Vertex AI REST shape, ``persia_core.cluster_spec.worker_pool_specs``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from persia_core import memory as M
from persia_core.argchecks import check_output_file, float_in
from persia_core.config import OPTIMIZERS

WEIGHT_BYTES = {k: v for k, v in M.STORAGE_BYTES.items()}
MAX_ROWS_PER_SHARD = int(np.iinfo(np.int32).max)
"""Rows one shard process can hold: the table's row numbers (index slots, recency queue) are int32."""
INDEX_SLOT_BYTES = 4
"""One int32 slot of the table's hash index."""
TB = 10**12
SKEW_SIGMAS = 4.0


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


def _state_bytes(optimizer: str, dim: int) -> int:
    return sum(
        int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        for shape, dt in M.state_shapes(optimizer, dim).values()
    )


def capacity_for_budget(
    budget_bytes: int, optimizer: str, dim: int, weights: str = "fp32", max_rows: int = MAX_ROWS_PER_SHARD
) -> tuple[int, int]:
    """Rows one shard process holds in ``budget_bytes``, and its hash-index slots.

    The search of ``memory.capacity_for_budget`` (power-of-two slot counts, load <= ``memory.MAX_LOAD``) with the
    per-row bytes of ``weights`` and at most ``max_rows`` rows; equal to it for fp32. Returns ``(0, 0)`` when
    fewer than 1024 rows fit."""
    per_row = row_bytes_without_index(optimizer, dim, weights)
    budget_bytes -= M.QUEUE_FIXED_BYTES
    best, best_slots = 0, 0
    slots = 1024
    while slots * INDEX_SLOT_BYTES < budget_bytes:
        cap = min(int(slots * M.MAX_LOAD), (budget_bytes - INDEX_SLOT_BYTES * slots) // per_row, max_rows)
        if cap > best:
            best, best_slots = int(cap), slots
        slots *= 2
    return (best, best_slots) if best >= 1024 else (0, 0)


def row_bytes(optimizer: str, dim: int, weights: str, capacity: int, slots: int) -> RowBytes:
    """The per-row breakdown at ``capacity`` rows over ``slots`` index slots."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    state = _state_bytes(optimizer, dim)
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
    ps_machine_type: str = "m2-ultramem-416"
    gpu_machine_type: str = "a2-highgpu-8g"
    accelerator_type: str = "NVIDIA_TESLA_A100"
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
    steps_per_s: float
    net_lookup_bytes_per_step: float
    net_push_bytes_per_step: float
    net_allreduce_bytes_per_step: float
    ps_gbps_per_server: float
    worker_pool_specs: list[dict] = field(default_factory=list)

    @property
    def net_bytes_per_step(self) -> float:
        return self.net_lookup_bytes_per_step + self.net_push_bytes_per_step + self.net_allreduce_bytes_per_step


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
        cap, slots = capacity_for_budget(budget, inp.optimizer, inp.dim, inp.weights)
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


def _servers_needed(rows: int, k: int, cap: int) -> int:
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
    from persia_core.cluster_spec import Machine, worker_pool_specs

    servers, k, cap, budget, slots = min(
        (_servers_needed(inp.rows, k, cap), k, cap, budget, slots) for k, cap, budget, slots in _layouts(inp)
    )
    rb = row_bytes(inp.optimizer, inp.dim, inp.weights, cap, slots)
    total_shards = servers * k
    mean = inp.rows / total_shards
    gpus_needed = max(1, math.ceil(inp.throughput / inp.samples_per_gpu))
    nn_vms = math.ceil(gpus_needed / inp.gpus_per_vm)
    gpus = nn_vms * inp.gpus_per_vm  # whole VMs; one DDP rank per GPU
    steps_per_s = inp.throughput / (gpus * inp.batch_size)
    unique = inp.batch_size * inp.ids_per_sample * inp.unique_fraction
    row_wire = 4 * inp.dim
    lookup = unique * (8 + row_wire)
    push = unique * (8 + row_wire)
    allreduce = 2 * (gpus - 1) / gpus * 4 * inp.dense_params if gpus > 1 else 0.0
    ps_gbps = (lookup + push) * gpus * steps_per_s * 8 / servers / 1e9
    accel = inp.accelerator_type if inp.gpus_per_vm else ""
    specs = worker_pool_specs(
        nn_machine=Machine(inp.gpu_machine_type, accel, inp.gpus_per_vm if accel else 0),
        ps_machine=Machine(inp.ps_machine_type),
        nn_replicas=nn_vms,
        ps_replicas=servers,
        image=inp.image,
        args=["--shards-per-server", str(k), "--ranks-per-replica", str(inp.gpus_per_vm)],
    )
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
        steps_per_s=steps_per_s,
        net_lookup_bytes_per_step=lookup,
        net_push_bytes_per_step=push,
        net_allreduce_bytes_per_step=allreduce,
        ps_gbps_per_server=ps_gbps,
        worker_pool_specs=specs,
    )


def _si(x: float, unit: str = "B") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def format_table(p: Plan) -> str:
    """The plan as a two-column table; the last line is ``parameter_servers=N``."""
    i, rb = p.inputs, p.row_bytes
    usable = i.vm_ram_tb * TB * i.usable
    rows = [
        ("parameters", f"{i.rows * i.dim:.4g} ({i.rows:.4g} rows x dim {i.dim})"),
        (
            "bytes per row",
            f"{rb.total:.2f} = key {rb.key} + LRU {rb.lru} + last-used {rb.last_used} + weights "
            f"{i.weights} {rb.weights} + {i.optimizer} state {rb.optimizer_state} + "
            f"hash index {rb.index:.2f}",
        ),
        ("server RAM usable", f"{_si(usable)} ({i.vm_ram_tb:g} TB x {i.usable:g})"),
        (
            "shard processes/server",
            f"{p.shards_per_server} (<= {MAX_ROWS_PER_SHARD:,} rows each: int32 row "
            f"numbers; {i.process_overhead_gb:g} GB overhead each)",
        ),
        ("rows/shard capacity", f"{p.rows_per_shard_capacity:,} in {_si(p.shard_budget_bytes)}"),
        ("rows/shard planned", f"{p.rows_per_shard:,.0f} (hash routing, {SKEW_SIGMAS:g} sigma headroom)"),
        (
            "memory/server",
            f"{_si(p.memory_per_server_bytes)} of {_si(i.vm_ram_tb * TB)} "
            f"({p.memory_per_server_bytes / (i.vm_ram_tb * TB):.1%}) with every shard at capacity",
        ),
        ("total shards", f"{p.total_shards:,}"),
        (
            "embedding memory",
            f"{_si(p.memory_per_server_bytes * p.parameter_servers)} on "
            f"{_si(p.parameter_servers * i.vm_ram_tb * TB)} of servers",
        ),
        (
            "NN worker GPUs",
            f"{p.gpus} on {p.nn_vms} x {i.gpu_machine_type} ({i.gpus_per_vm} x "
            f"{i.accelerator_type}); {math.ceil(i.throughput / i.samples_per_gpu)} needed for "
            f"{i.throughput:.4g} samples/s at {i.samples_per_gpu:.4g} per GPU",
        ),
        ("steps/s", f"{p.steps_per_s:.2f} (batch {i.batch_size} per GPU)"),
        (
            "network/step/worker",
            f"{_si(p.net_bytes_per_step)} = lookup {_si(p.net_lookup_bytes_per_step)} + push "
            f"{_si(p.net_push_bytes_per_step)} + all-reduce "
            f"{_si(p.net_allreduce_bytes_per_step)}",
        ),
        (
            "network/server",
            f"{p.ps_gbps_per_server:.2f} Gbit/s of {i.nic_gbps:g} ({p.ps_gbps_per_server / i.nic_gbps:.1%})",
        ),
        (
            "worker pools",
            "; ".join(
                f"pool {n}: {s['replicaCount']} x {s['machineSpec']['machineType']}"
                for n, s in enumerate(p.worker_pool_specs)
                if s
            )
            or "-",
        ),
    ]
    rows.append(
        (
            "note",
            "a table grows by doubling its arrays; keep shards preallocated or below half their "
            "capacity while growing, or the copy's transient peak (1.5x) exceeds this budget",
        )
    )
    if i.weights != "fp32":
        rows.append(
            (
                "note",
                f"run with embedding.storage: {i.weights} in the run config (weights stored "
                f"{i.weights}, optimizer state fp32)",
            )
        )
    width = max(len(k) for k, _ in rows)
    out = [f"{'quantity':<{width}}  value", f"{'-' * width}  {'-' * 5}"]
    out += [f"{k:<{width}}  {v}" for k, v in rows]
    out.append(f"parameter_servers={p.parameter_servers}")
    return "\n".join(out)


def to_json(p: Plan) -> dict:
    d = asdict(p)
    d["row_bytes"]["total"] = p.row_bytes.total
    d["net_bytes_per_step"] = p.net_bytes_per_step
    return d


def _count(text: str) -> float:
    """``1e14``, ``100_000``, ``3.2T`` -> a finite number. ``ValueError`` otherwise (``inf``, ``nan`` too)."""
    s = text.strip().replace("_", "").replace(",", "")
    mult = {"k": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12, "P": 1e15}
    try:
        value = float(s[:-1]) * mult[s[-1]] if s and s[-1] in mult else float(s)
    except ValueError:
        raise ValueError(f"expected a number such as 1e14, 100_000 or 3.2T, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def _count_arg(text: str) -> float:
    """``_count`` for argparse: its error names the flag."""
    try:
        return _count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    """CLI (``python -m persia_core.planner`` / ``python -m persia_core plan``). See ``--help``."""
    p = argparse.ArgumentParser(
        prog="persia plan",
        description="Capacity plan: parameter servers, NN-worker "
        "GPUs, network bytes per step and the Vertex AI worker pools.",
    )
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=_count_arg, help="embedding parameters (rows x dim), e.g. 1e14")
    size.add_argument("--ids", type=_count_arg, help="distinct feature IDs (rows) over all slots")
    size.add_argument(
        "--slot", action="append", metavar="NAME=IDS", help="expected distinct IDs of one slot (repeat per slot)"
    )
    d = PlanInputs(rows=1)
    p.add_argument("--dim", type=int, default=d.dim, help="embedding dim D")
    p.add_argument("--weights", choices=sorted(WEIGHT_BYTES), default=d.weights, help="weight storage precision")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer, help="server-side optimizer")
    p.add_argument("--vm-ram-tb", type=float_in(), default=d.vm_ram_tb, help="RAM of a parameter-server VM, TB")
    p.add_argument("--usable", type=float_in(), default=d.usable, help="share of that RAM the shards may use")
    p.add_argument(
        "--process-overhead-gb",
        type=float_in(),
        default=d.process_overhead_gb,
        help="memory of a shard process besides its table, GB",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per GPU per step")
    p.add_argument("--throughput", type=_count_arg, default=d.throughput, help="target samples/s of the job")
    p.add_argument("--samples-per-gpu", type=_count_arg, default=d.samples_per_gpu, help="samples/s of one GPU")
    p.add_argument("--gpus-per-vm", type=int, default=d.gpus_per_vm, help="GPUs of an NN-worker VM")
    p.add_argument(
        "--ids-per-sample",
        type=float_in(),
        default=0.0,
        help="feature IDs per sample (default: the number of --slot, else 26 as Criteo's)",
    )
    p.add_argument(
        "--unique-fraction", type=float_in(), default=d.unique_fraction, help="share of a batch's IDs left after dedup"
    )
    p.add_argument("--dense-params", type=_count_arg, default=d.dense_params, help="dense network parameters")
    p.add_argument("--nic-gbps", type=float_in(), default=d.nic_gbps, help="network of a parameter-server VM, Gbit/s")
    p.add_argument("--ps-machine-type", default=d.ps_machine_type, help="parameter-server machine type")
    p.add_argument("--gpu-machine-type", default=d.gpu_machine_type, help="NN-worker machine type")
    p.add_argument("--accelerator-type", default=d.accelerator_type, help="NN-worker accelerator")
    p.add_argument("--image", default=d.image, help="container image URI for the worker-pool specs")
    p.add_argument("--json", default="", help="also write the plan (with the worker-pool specs) here")
    args = p.parse_args(argv)
    if args.dim < 1:
        p.error(f"--dim must be >= 1, got {args.dim}")
    try:
        if args.params is not None:
            if args.params < 1:
                raise ValueError(f"--params must be >= 1, got {args.params:g}")
            rows = math.ceil(args.params / args.dim)
            ids_per_sample = args.ids_per_sample or 26.0
        elif args.ids is not None:
            if args.ids < 1:
                raise ValueError(f"--ids must be >= 1, got {args.ids:g}")
            rows = math.ceil(args.ids)
            ids_per_sample = args.ids_per_sample or 26.0
        else:
            per_slot = {}
            for item in args.slot:
                name, sep, value = item.partition("=")
                if not sep or not name:
                    raise ValueError(f"--slot expects NAME=IDS, got {item!r}")
                try:
                    per_slot[name] = _count(value)
                except ValueError as e:
                    raise ValueError(f"--slot {item}: {e}") from None
                if per_slot[name] < 1:
                    raise ValueError(f"--slot {item}: IDS must be >= 1")
            rows = math.ceil(sum(per_slot.values()))
            ids_per_sample = args.ids_per_sample or float(len(per_slot))
        inp = PlanInputs(
            rows=rows,
            dim=args.dim,
            weights=args.weights,
            optimizer=args.optimizer,
            vm_ram_tb=args.vm_ram_tb,
            usable=args.usable,
            process_overhead_gb=args.process_overhead_gb,
            batch_size=args.batch_size,
            throughput=args.throughput,
            samples_per_gpu=args.samples_per_gpu,
            gpus_per_vm=args.gpus_per_vm,
            ids_per_sample=ids_per_sample,
            unique_fraction=args.unique_fraction,
            dense_params=args.dense_params,
            nic_gbps=args.nic_gbps,
            ps_machine_type=args.ps_machine_type,
            gpu_machine_type=args.gpu_machine_type,
            accelerator_type=args.accelerator_type,
            image=args.image,
        )
        if args.json:
            check_output_file("--json", args.json)
        result = plan(inp)
    except ValueError as e:
        p.error(str(e))
    if args.json:
        from persia_core import io

        try:
            io.write_text(args.json, json.dumps(to_json(result), indent=1) + "\n")
        except OSError as e:
            p.error(f"--json {args.json}: cannot write it: {e.strerror or e}")
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
