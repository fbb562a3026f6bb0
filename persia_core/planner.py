"""Capacity planner CLI: the plan of ``persia_core.capacity_plan`` from command-line sizes, printed as a table.

    python -m persia_core.planner --params 1e14 --dim 32 --weights fp16 --optimizer rowwise_adagrad \\
        --vm-ram-tb 12 --usable 0.9          (also: python -m persia_core plan ...)

The plan prints as a table whose last line is ``parameter_servers=N``; ``--json`` also writes it with the
worker-pool specs (Vertex AI REST shape, ``persia_core.cluster_spec.worker_pool_specs``) and the GKE node pools of the
same machines with the ``PERSIA_K8S_*`` settings of the Kubeflow target (layout and pod resources,
``kubeflow_settings``; null where a machine's shape is unknown, see ``kubeflow_notes``) and the pipeline parameters
the run must use so that the counts divide (``pipeline_parameters``). ``--accelerator-type none``: CPU-only NN
workers (no GPU in their pools, ``PERSIA_K8S_GPUS=0``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from persia_core import io
from persia_core.argchecks import check_output_file, float_in
from persia_core.capacity_plan import (
    CPU_NN_MACHINE_TYPE,
    EW_BUSY,
    GIB,
    GPU_NN_MACHINE_TYPE,
    MAX_ROWS_PER_SHARD,
    SKEW_SIGMAS,
    TB,
    WEIGHT_BYTES,
    Plan,
    PlanInputs,
    plan,
    pod_fit,
)
from persia_core.config import OPTIMIZERS


def _si(x: float, unit: str = "B") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def format_table(p: Plan) -> str:
    """The plan as a two-column table; the last line is ``parameter_servers=N``."""
    i, rb = p.inputs, p.row_bytes
    ps_fit = pod_fit(i.ps_machine_type)
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
        ("rows/shard capacity", f"{p.rows_per_shard_capacity:,} (a shard's budget: {_si(p.shard_budget_bytes)})"),
        ("rows/shard planned", f"{p.rows_per_shard:,.0f} (hash routing, {SKEW_SIGMAS:g} sigma headroom)"),
        (
            "memory/server",
            f"{_si(p.memory_per_server_bytes)} of {_si(i.vm_ram_tb * TB)} "
            f"({p.memory_per_server_bytes / (i.vm_ram_tb * TB):.1%}) with every shard at capacity",
        ),
        ("total shards", f"{p.total_shards:,}"),
        (
            "embedding memory",
            f"{_si(p.memory_per_server_bytes * p.parameter_servers)} with every shard at capacity, on "
            f"{_si(p.parameter_servers * i.vm_ram_tb * TB)} of servers",
        ),
        (
            "NN worker GPUs" if i.accelerator_type else "NN workers (CPU)",
            f"{p.gpus} on {p.nn_vms} x {i.gpu_machine_type} ("
            + (f"{i.gpus_per_vm} x {i.accelerator_type}" if i.accelerator_type else f"{i.gpus_per_vm} each, no GPU")
            + f"); {math.ceil(i.throughput / i.samples_per_gpu)} needed for "
            f"{i.throughput:.4g} samples/s at {i.samples_per_gpu:.4g} per "
            + ("GPU" if i.accelerator_type else "worker"),
        ),
        (
            "embedding workers",
            f"{p.embedding_worker_cores:,} cores needed ({i.ew_cpu_us_per_sample:g} us of CPU per sample at "
            f"26 IDs, x {i.ids_per_sample:g}/26 IDs here, cores {EW_BUSY:.0%} busy); "
            f"{p.embedding_workers_per_nn_worker} per NN worker = {p.embedding_workers_per_nn_worker * p.gpus:,} "
            f"processes on {p.embedding_worker_vms:,} x {i.ew_machine_type} ({i.ew_cores_per_vm} cores)",
        ),
        ("steps/s", f"{p.steps_per_s:.2f} (batch {i.batch_size} per {'GPU' if i.accelerator_type else 'NN worker'})"),
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
        (
            "GKE node pools",
            "; ".join(
                f"{g['name']}: {g['nodes']} x {g['machine_type']}"
                + (f" ({g['accelerator_count']} x {g['accelerator']})" if g["accelerator_count"] else "")
                for g in p.gke_node_pools
            ),
        ),
        ("Kubeflow settings", " ".join(f"{k}={v}" for k, v in p.kubeflow_settings.items() if v is not None)),
        ("pipeline parameters", " ".join(f"{k}={v}" for k, v in p.pipeline_parameters.items())),
        (
            "note",
            "Kubeflow pods, one per node, request vCPUs - 1 and 90% of the machine's memory - 1 GiB (the rest: "
            "GKE's reserved share, system DaemonSets, the Cloud Storage FUSE sidecar); an NN pod's memory limit "
            "is NN_MEMORY + SHM_SIZE; a parameter server's follows the run's shard plan: about "
            f"{p.ps_pod_memory_bytes / GIB:,.0f} GiB at this shard budget"
            + (f" of the {ps_fit[1]:,} GiB that fit one {i.ps_machine_type} node" if ps_fit else ""),
        ),
    ]
    rows += [("note", n) for n in p.kubeflow_notes]
    rows.append(
        (
            "note",
            "a table grows by doubling its arrays; keep shards preallocated or below half their "
            "capacity while growing, or the copy's transient peak (1.5x) exceeds this budget",
        )
    )
    rows.append(
        (
            "note",
            "embedding workers (pool 3) feed their NN worker over a gRPC stream: 4 x (S x D + F + 1) bytes per "
            "sample to it and 4 x S x D back (S slots of dim D, F dense features)",
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
    p.add_argument(
        "--gpus-per-vm",
        type=int,
        default=d.gpus_per_vm,
        help="GPUs of an NN-worker VM (CPU-only: NN worker processes per VM)",
    )
    p.add_argument(
        "--ids-per-sample",
        type=float_in(),
        default=None,
        help="feature IDs per sample (default: the number of --slot, else 26 as Criteo's)",
    )
    p.add_argument(
        "--unique-fraction", type=float_in(), default=d.unique_fraction, help="share of a batch's IDs left after dedup"
    )
    p.add_argument("--dense-params", type=_count_arg, default=d.dense_params, help="dense network parameters")
    p.add_argument("--nic-gbps", type=float_in(), default=d.nic_gbps, help="network of a parameter-server VM, Gbit/s")
    p.add_argument(
        "--ew-cpu-us-per-sample",
        type=float_in(),
        default=d.ew_cpu_us_per_sample,
        help="embedding-worker CPU microseconds per sample at 26 IDs per sample: the "
        "embedding_worker_cpu_us_per_sample that make bench-feed prints (default: its figure on a 2-core VM)",
    )
    p.add_argument("--ew-cores-per-vm", type=int, default=d.ew_cores_per_vm, help="cores of an embedding-worker VM")
    p.add_argument("--ew-machine-type", default=d.ew_machine_type, help="embedding-worker machine type")
    p.add_argument("--ps-machine-type", default=d.ps_machine_type, help="parameter-server machine type")
    p.add_argument(
        "--gpu-machine-type",
        default="",
        help=f"NN-worker machine type (default {GPU_NN_MACHINE_TYPE}, a2-highgpu-Ng for N A100s per VM, CPU-only "
        f"{CPU_NN_MACHINE_TYPE})",
    )
    p.add_argument(
        "--accelerator-type",
        default=d.accelerator_type,
        help="NN-worker GPU, Vertex AI's name (e.g. NVIDIA_TESLA_A100); 'none' for CPU-only NN workers",
    )
    p.add_argument("--image", default=d.image, help="container image URI for the worker-pool specs")
    p.add_argument("--json", default="", help="also write the plan (with the worker-pool specs) here")
    args = p.parse_args(argv)
    if args.dim < 1:
        p.error(f"--dim must be >= 1, got {args.dim}")
    if args.ids_per_sample is not None and args.ids_per_sample <= 0:
        p.error(f"--ids-per-sample must be > 0, got {args.ids_per_sample:g}")
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
            ew_cpu_us_per_sample=args.ew_cpu_us_per_sample,
            ew_cores_per_vm=args.ew_cores_per_vm,
            ew_machine_type=args.ew_machine_type,
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
        try:
            io.write_text(args.json, json.dumps(to_json(result), indent=1) + "\n")
        except OSError as e:
            p.error(f"--json {args.json}: cannot write it: {e.strerror or e}")
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
