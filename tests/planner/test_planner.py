"""persia_core.capacity_plan and persia_core.planner: bytes per row from the table's accounting, the 100-trillion
seed plan, the CLI."""

import json
import math

import pytest

from persia_core import capacity_plan, memory, planner
from persia_core.config import OPTIMIZERS

SEED_ARGS = [
    "--params",
    "1e14",
    "--dim",
    "32",
    "--weights",
    "fp16",
    "--optimizer",
    "rowwise_adagrad",
    "--vm-ram-tb",
    "12",
    "--usable",
    "0.9",
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("budget", [1 << 20, 10**9, 3 * 10**10 + 7])
def test_planner_fp32_capacity_equals_the_tables_own_capacity_for_budget(optimizer, budget):
    cap, slots = memory.capacity_and_slots(budget, optimizer, 32, max_rows=capacity_plan.MAX_ROWS_PER_SHARD)
    assert cap == memory.capacity_for_budget(budget, optimizer, 32)
    assert cap * capacity_plan.row_bytes_without_index(optimizer, 32) + 4 * slots <= budget
    assert capacity_plan.row_bytes_without_index(optimizer, 32) == memory.row_bytes_without_index(optimizer, 32)


def test_planner_fp16_weights_save_two_bytes_per_float_and_nothing_else():
    for opt in ("sgd", "rowwise_adagrad", "adam"):
        assert (
            capacity_plan.row_bytes_without_index(opt, 32, "fp32")
            - capacity_plan.row_bytes_without_index(opt, 32, "fp16")
            == 2 * 32
        )
    rb = capacity_plan.row_bytes("rowwise_adagrad", 32, "fp16", 1000, 2048)
    assert (rb.key, rb.lru, rb.last_used, rb.weights, rb.optimizer_state) == (8, 10, 4, 64, 4)
    assert rb.without_index == capacity_plan.row_bytes_without_index("rowwise_adagrad", 32, "fp16")


def test_planner_follows_the_table_accounting_not_a_constant(monkeypatch):
    base = capacity_plan.plan(capacity_plan.PlanInputs(rows=10**9, dim=32, vm_ram_tb=0.05))
    real = memory.row_bytes_without_index
    monkeypatch.setattr(
        memory, "row_bytes_without_index", lambda opt, dim, storage="fp32": real(opt, dim, storage) + 64
    )
    bigger = capacity_plan.plan(capacity_plan.PlanInputs(rows=10**9, dim=32, vm_ram_tb=0.05))
    assert bigger.row_bytes.without_index == base.row_bytes.without_index + 64
    assert bigger.parameter_servers > base.parameter_servers


def test_planner_puts_100_trillion_parameters_on_at_most_the_seeds_30_servers(capsys):
    assert planner.main(SEED_ARGS) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("parameter_servers=")
    n = int(out[-1].split("=")[1])
    assert 1 <= n <= 30
    p = capacity_plan.plan(
        capacity_plan.PlanInputs(
            rows=int(1e14 / 32), dim=32, weights="fp16", optimizer="rowwise_adagrad", vm_ram_tb=12, usable=0.9
        )
    )
    assert p.parameter_servers == n
    assert p.row_bytes.total <= 104  # 360 TB x 0.9 / 3.125e12 rows
    assert p.memory_per_server_bytes <= 12e12 * 0.9
    assert p.total_shards * p.rows_per_shard_capacity >= 1e14 / 32
    assert p.rows_per_shard_capacity <= 2**31 - 1
    assert any(line.startswith("bytes per row") for line in out)


def test_planner_fp32_weights_do_not_fit_100_trillion_on_30_servers():
    p = capacity_plan.plan(
        capacity_plan.PlanInputs(rows=int(1e14 / 32), dim=32, weights="fp32", vm_ram_tb=12, usable=0.9)
    )
    assert p.parameter_servers > 30


def test_planner_small_model_gets_one_server_one_shard_and_slot_sizes_add_up(capsys, tmp_path):
    out = tmp_path / "plan.json"
    rc = planner.main(
        [
            "--slot",
            "user=1e6",
            "--slot",
            "item=2e5",
            "--dim",
            "16",
            "--vm-ram-tb",
            "0.064",
            "--throughput",
            "2e5",
            "--samples-per-gpu",
            "5e4",
            "--gpus-per-vm",
            "1",
            "--gpu-machine-type",
            "a2-highgpu-1g",
            "--image",
            "us-docker.pkg.dev/p/r/persia:1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "parameter_servers=1"
    d = json.loads(out.read_text())
    assert d["inputs"]["rows"] == 1_200_000 and d["inputs"]["ids_per_sample"] == 2
    assert d["shards_per_server"] == 1 and d["gpus"] == 4 and d["nn_vms"] == 4
    pools = d["worker_pool_specs"]
    assert [p["replicaCount"] for p in pools] == [1, 3, 1, d["embedding_worker_vms"]]
    assert pools[0]["machineSpec"] == {
        "machineType": "a2-highgpu-1g",
        "acceleratorType": "NVIDIA_TESLA_A100",
        "acceleratorCount": 1,
    }
    assert pools[2]["machineSpec"] == {"machineType": "m2-ultramem-416"}
    assert all(p["containerSpec"]["command"] == ["python", "-m", "persia_core.cluster"] for p in pools)
    assert pools[2]["containerSpec"]["args"][:2] == ["--shards-per-server", "1"]
    # the same machines as GKE node pools, one per role, and the Kubeflow settings that fill them one pod a node
    assert d["gke_node_pools"] == [
        dict(name="persia-nn", role="nn-worker", machine_type="a2-highgpu-1g", nodes=4)
        | dict(accelerator="nvidia-tesla-a100", accelerator_count=1, vcpus=12, memory_gb=85),
        dict(name="persia-ps", role="parameter-server", machine_type="m2-ultramem-416", nodes=1)
        | dict(accelerator="", accelerator_count=0, vcpus=416, memory_gb=11776),
        dict(name="persia-ew", role="embedding-worker", machine_type=pools[3]["machineSpec"]["machineType"])
        | dict(nodes=d["embedding_worker_vms"], accelerator="", accelerator_count=0, vcpus=32, memory_gb=32),
    ]
    per = pools[3]["containerSpec"]["args"][
        pools[3]["containerSpec"]["args"].index("--embedding-workers-per-replica") + 1
    ]
    # one pod per node: vCPUs - 1, 90% of the memory - 1 GiB (NN: NN_MEMORY + SHM_SIZE, its limit)
    assert d["kubeflow_settings"] == {
        "PERSIA_K8S_GPUS": 1,
        "PERSIA_K8S_RANKS_PER_REPLICA": 1,
        "PERSIA_K8S_SHARDS_PER_SERVER": 1,
        "PERSIA_K8S_EMBEDDING_WORKERS": d["embedding_workers_per_nn_worker"],
        "PERSIA_K8S_EMBEDDING_WORKERS_PER_REPLICA": int(per),
        "PERSIA_K8S_NN_CPU": "11",
        "PERSIA_K8S_NN_MEMORY": "59Gi",  # floor(0.9 x 85 - 1) = 75, less 16Gi of /dev/shm
        "PERSIA_K8S_SHM_SIZE": "16Gi",
        "PERSIA_K8S_PS_CPU": "415",
        "PERSIA_K8S_EW_CPU": "31",
        "PERSIA_K8S_EW_MEMORY": "27Gi",  # floor(0.9 x 32 - 1)
    }
    assert d["pipeline_parameters"] == {"num_parameter_servers": 1, "num_nn_workers": 4}
    assert d["kubeflow_notes"] == []


def test_planner_network_bytes_per_step_count_ids_rows_and_the_dense_all_reduce():
    p = capacity_plan.plan(
        capacity_plan.PlanInputs(
            rows=10**6,
            dim=8,
            batch_size=100,
            ids_per_sample=3,
            unique_fraction=0.5,
            dense_params=1000,
            throughput=1e5,
            samples_per_gpu=5e4,
            gpus_per_vm=2,
            vm_ram_tb=0.01,
        )
    )
    unique = 100 * 3 * 0.5
    assert p.net_lookup_bytes_per_step == unique * (8 + 4 * 8) == p.net_push_bytes_per_step
    assert p.gpus == 2 and p.net_allreduce_bytes_per_step == 2 * (2 - 1) / 2 * 4 * 1000


@pytest.mark.parametrize(
    "bad",
    [
        ["--params", "1e14", "--usable", "1.5"],
        ["--params", "1e14", "--weights", "fp8"],
        ["--dim", "32"],
        ["--params", "x"],
        ["--slot", "novalue"],
    ],
)
def test_planner_cli_rejects_bad_input_with_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        planner.main(bad)
    assert e.value.code == 2


@pytest.mark.processes
def test_planner_runs_as_persia_core_plan_and_as_its_own_module():
    import subprocess
    import sys

    for module in (["persia_core", "plan"], ["persia_core.planner"]):
        out = (
            subprocess.run(
                [sys.executable, "-m", *module, *SEED_ARGS], capture_output=True, text=True, check=True, timeout=120
            )
            .stdout.strip()
            .splitlines()
        )
        assert out[-1].startswith("parameter_servers=") and int(out[-1].split("=")[1]) <= 30


@pytest.mark.parametrize("dim", ["0", "-4"])
def test_planner_refuses_a_dim_below_one_naming_the_flag(dim, capsys):
    with pytest.raises(SystemExit) as e:
        planner.main(["--params", "1e14", "--dim", dim])
    assert e.value.code == 2 and "--dim must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--params", "inf"], "--params"),
        (["--params", "nan"], "--params"),
        (["--params", "-5"], "--params"),
        (["--ids", "-3"], "--ids"),
        (["--slot", "user=inf"], "--slot"),
        (["--params", "1e14", "--usable", "nan"], "--usable"),
        (["--params", "1e14", "--vm-ram-tb", "inf"], "--vm-ram-tb"),
        (["--params", "1e14", "--ids-per-sample", "-1"], "--ids-per-sample"),
    ],
)
@pytest.mark.processes
def test_planner_refuses_non_finite_or_non_positive_sizes_naming_the_flag(args, flag):
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "persia_core", "plan", *args], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2, p.stderr
    error = p.stderr.strip().splitlines()[-1]  # above it: the usage, which lists every flag
    assert flag in error and "Traceback" not in p.stderr
    assert "rows=" not in error  # the user gave no rows: the message speaks of the flag


def test_planner_json_under_a_file_or_at_a_folder_exits_2_naming_the_path(tmp_path, capsys):
    (tmp_path / "ro").write_text("a file, not a folder")
    for target in (tmp_path / "ro" / "plan.json", tmp_path):
        with pytest.raises(SystemExit) as e:
            planner.main(["--params", "1e14", "--json", str(target)])
        assert e.value.code == 2
        assert f"--json {target}" in capsys.readouterr().err.strip().splitlines()[-1]


def test_planner_a_huge_model_plans_quickly_and_matches_the_linear_search():
    import math
    import time

    t0 = time.perf_counter()
    p = capacity_plan.plan(capacity_plan.PlanInputs(rows=10**29, dim=32))
    assert time.perf_counter() - t0 < 10 and p.parameter_servers > 10**16

    def linear(rows, k, cap):
        servers = max(1, math.ceil(rows / (k * cap)))
        while (m := rows / (servers * k)) * (1 + capacity_plan.SKEW_SIGMAS / math.sqrt(max(m, 1.0))) > cap:
            servers += 1
        return servers

    for rows, k, cap in [
        (1, 1, 1024),
        (10**6, 3, 1024),
        (10**9, 7, 5000),
        (12345678901, 2, 2**20),
        (10**12, 1, 2**31 - 1),
    ]:
        assert capacity_plan.servers_needed(rows, k, cap) == linear(rows, k, cap)


def test_planner_sizes_the_embedding_workers_from_the_cpu_cost_per_sample_given_or_bench_feeds(capsys):
    # cores = ceil(samples/s x CPU s per sample x (IDs per sample / 26) / 0.8 busy), on VMs of --ew-cores-per-vm
    assert planner.main([*SEED_ARGS, "--throughput", "2e6", "--ids-per-sample", "52"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("embedding workers"))
    default = capacity_plan.PlanInputs(rows=1).ew_cpu_us_per_sample
    cores = math.ceil(2e6 * default * 1e-6 * 2 / 0.8)
    assert f"{cores:,} cores needed" in line and "x n2-highcpu-32 (32 cores)" in line
    args = ["--ew-cpu-us-per-sample", "2.5", "--ew-cores-per-vm", "16", "--ew-machine-type", "c3-highcpu-22"]
    assert planner.main([*SEED_ARGS, "--throughput", "1e6", *args]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("embedding workers"))
    assert "4 cores needed (2.5 us of CPU per sample" in line  # ceil(2.5 / 0.8)
    # at least one per NN worker, in equal replicas of at most 16
    gpus = capacity_plan.plan(capacity_plan.PlanInputs(rows=1, throughput=1e6)).gpus
    per_vm = max(d for d in range(1, 17) if gpus % d == 0)
    assert f"1 per NN worker = {gpus} processes on {gpus // per_vm} x c3-highcpu-22 (16 cores)" in line
    p = capacity_plan.plan(capacity_plan.PlanInputs(rows=10**6, throughput=1.6e7, ew_cpu_us_per_sample=1.0))
    assert p.embedding_worker_cores == 20
    # pool 3 holds E per NN worker, at least one each, in equal replicas of at most 32 processes
    e = p.embedding_workers_per_nn_worker
    assert e == max(1, math.ceil(20 / p.gpus)) and p.embedding_worker_vms * 32 >= p.gpus * e
    ew = p.worker_pool_specs[3]
    assert ew["replicaCount"] == p.embedding_worker_vms and ew["machineSpec"] == {"machineType": "n2-highcpu-32"}
    args = ew["containerSpec"]["args"]
    per = int(args[args.index("--embedding-workers-per-replica") + 1])
    assert args[args.index("--embedding-workers") + 1] == str(e) and per * p.embedding_worker_vms == p.gpus * e
    small = capacity_plan.plan(capacity_plan.PlanInputs(rows=10**6, throughput=2e5, ew_cpu_us_per_sample=40.0))
    assert small.gpus < small.embedding_worker_cores and small.embedding_workers_per_nn_worker > 1
    assert "make bench-feed" in planner_help()


def planner_help() -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        planner.main(["--help"])
    return " ".join(buf.getvalue().split())


QUANTITY_BYTES = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(q: str) -> float:
    """A Kubernetes quantity as a number: bytes for memory (``27Gi``), cores for CPU (``31``, ``500m``)."""
    import re

    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G)?", q)
    assert m, q
    value, unit = float(m.group(1)), m.group(2) or ""
    return value / 1000 if unit == "m" else value * QUANTITY_BYTES[unit]


def seed_plan(**kw):
    return capacity_plan.plan(
        capacity_plan.PlanInputs(
            rows=int(1e14 / 32), dim=32, weights="fp16", optimizer="rowwise_adagrad", vm_ram_tb=12, usable=0.9, **kw
        )
    )


@pytest.mark.parametrize("spelling", ["none", "None", "NONE", ""])
def test_planner_cpu_only_nn_workers_get_a_node_pool_without_gpus_and_zero_gpus_per_pod(spelling, tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--params", "1e9", "--gpus-per-vm", "4", "--accelerator-type", spelling, "--json", str(out)]
    assert planner.main(args) == 0
    table = capsys.readouterr().out
    d = json.loads(out.read_text())
    nn = d["gke_node_pools"][0]
    assert nn["accelerator"] == "" and nn["accelerator_count"] == 0
    assert nn["machine_type"] == capacity_plan.CPU_NN_MACHINE_TYPE  # a CPU machine by default, not a2-highgpu
    assert "acceleratorType" not in d["worker_pool_specs"][0]["machineSpec"]
    s = d["kubeflow_settings"]
    assert s["PERSIA_K8S_GPUS"] == 0 and s["PERSIA_K8S_RANKS_PER_REPLICA"] == 4  # ranks as planned
    assert d["pipeline_parameters"]["num_nn_workers"] == d["gpus"] and d["gpus"] % 4 == 0
    assert "none" not in table.lower().split("gke node pools")[1].splitlines()[0]
    assert "PERSIA_K8S_GPUS=0 " in table and table.strip().splitlines()[-1] == "parameter_servers=1"
    # the Kubeflow settings build: a CPU-only NN pod of 4 ranks, no GPU asked for
    from pipelines.kubeflow import KubeflowSettings

    env = {k: str(v) for k, v in s.items() if v is not None}
    assert KubeflowSettings.from_env({"PERSIA_K8S_IMAGE": "us-docker.pkg.dev/p/r/persia:1", **env}).gpus == 0


def test_planner_cpu_only_refuses_a_machine_that_carries_gpus(capsys):
    with pytest.raises(SystemExit) as e:
        planner.main(["--params", "1e9", "--accelerator-type", "none", "--gpu-machine-type", "a2-highgpu-8g"])
    assert e.value.code == 2 and "carries GPUs" in capsys.readouterr().err
    # gcloud's spelling of a GPU is Vertex AI's
    p = capacity_plan.plan(capacity_plan.PlanInputs(rows=10**6, accelerator_type="nvidia-tesla-a100"))
    assert p.gke_node_pools[0]["accelerator"] == "nvidia-tesla-a100" and p.kubeflow_settings["PERSIA_K8S_GPUS"] == 8


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--gpu-machine-type", "n2-standard-16"], "NVIDIA_TESLA_A100 GPUs come only on a2-* machines"),
        (["--accelerator-type", "NVIDIA_FOO"], "'NVIDIA_FOO' is not a GPU this project knows"),
        (["--gpu-machine-type", "a2-highgpu-2g"], "a2-highgpu-2g carries 2 GPU(s), not --gpus-per-vm=8"),
        (["--ids-per-sample", "0"], "--ids-per-sample must be > 0"),
    ],
)
def test_planner_refuses_nn_machines_vertex_ai_would_refuse_and_a_zero_id_count(args, says, capsys):
    # found by a fresh-user trial: the plan wrote {'machineType': 'n2-standard-16', 'acceleratorType':
    # 'NVIDIA_TESLA_A100', 'acceleratorCount': 8}, which make compile (and Vertex AI) refuse; an unknown GPU passed;
    # and --ids-per-sample 0 was taken as the default 26
    with pytest.raises(SystemExit) as e:
        planner.main(["--ids", "1e6", *args])
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert planner.main(["--ids", "1e6", "--gpu-machine-type", "a2-highgpu-8g", "--ids-per-sample", "39"]) == 0


def test_planner_kubeflow_resources_of_the_seed_plan_fit_one_pod_per_node_of_its_machines():
    p = seed_plan()
    s = p.kubeflow_settings
    shapes = {pool["role"]: (pool["vcpus"], pool["memory_gb"] * (1 << 30)) for pool in p.gke_node_pools}
    assert shapes == {
        "nn-worker": (96, 680 * (1 << 30)),  # a2-highgpu-8g: 12 vCPUs, 85 GB per GPU
        "parameter-server": (416, 11776 * (1 << 30)),  # m2-ultramem-416
        "embedding-worker": (32, 32 * (1 << 30)),  # n2-highcpu-32
    }
    for role, cpu, mems in [
        ("nn-worker", "PERSIA_K8S_NN_CPU", ["PERSIA_K8S_NN_MEMORY", "PERSIA_K8S_SHM_SIZE"]),
        ("parameter-server", "PERSIA_K8S_PS_CPU", []),
        ("embedding-worker", "PERSIA_K8S_EW_CPU", ["PERSIA_K8S_EW_MEMORY"]),
    ]:
        vcpus, ram = shapes[role]
        assert 1 <= quantity(str(s[cpu])) <= vcpus - 1, (role, s[cpu])
        asked = sum(quantity(str(s[m])) for m in mems) if mems else p.ps_pod_memory_bytes
        assert 0 < asked <= 0.9 * ram - (1 << 30), (role, asked, ram)  # GKE's reserve and the system's
    assert quantity(str(s["PERSIA_K8S_EW_MEMORY"])) < 32 * (1 << 30)  # the highcpu-32's 32 GB: 32Gi never schedules
    # a parameter-server pod holds its k shards at the plan's budget, with the builder's overheads
    assert p.ps_pod_memory_bytes >= p.shards_per_server * p.shard_budget_bytes + (1 << 30)
    assert p.kubeflow_notes == []
    # the settings are valid Kubeflow settings
    from pipelines.kubeflow import KubeflowSettings

    KubeflowSettings.from_env(
        {"PERSIA_K8S_IMAGE": "us-docker.pkg.dev/p/r/persia:1", **{k: str(v) for k, v in s.items()}}
    )


def test_planner_pipeline_parameters_divide_by_the_kubeflow_settings(tmp_path, capsys):
    for p in (
        seed_plan(),
        seed_plan(accelerator_type="none", gpus_per_vm=3, throughput=4e5),
        capacity_plan.plan(capacity_plan.PlanInputs(rows=10**6, throughput=1.6e7, ew_cpu_us_per_sample=1.0)),
    ):
        s, params = p.kubeflow_settings, p.pipeline_parameters
        n, m = params["num_parameter_servers"], params["num_nn_workers"]
        assert n == p.total_shards and m == p.gpus
        assert n % int(s["PERSIA_K8S_SHARDS_PER_SERVER"]) == 0 and n // int(s["PERSIA_K8S_SHARDS_PER_SERVER"]) == (
            p.parameter_servers
        )
        assert m % int(s["PERSIA_K8S_RANKS_PER_REPLICA"]) == 0
        e, per = int(s["PERSIA_K8S_EMBEDDING_WORKERS"]), int(s["PERSIA_K8S_EMBEDDING_WORKERS_PER_REPLICA"])
        assert (m * e) % per == 0 and m * e // per == p.embedding_worker_vms
    out = tmp_path / "plan.json"
    assert planner.main([*SEED_ARGS, "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    p = seed_plan()
    row = next(x for x in lines if x.startswith("pipeline parameters"))
    assert row.split()[2:] == [f"num_parameter_servers={p.total_shards}", f"num_nn_workers={p.gpus}"]
    row = next(x for x in lines if x.startswith("Kubeflow settings"))
    assert "PERSIA_K8S_EW_MEMORY=27Gi" in row and "PERSIA_K8S_NN_CPU=95" in row
    assert lines[-1] == f"parameter_servers={p.parameter_servers}"
    assert json.loads(out.read_text())["pipeline_parameters"] == p.pipeline_parameters


@pytest.mark.parametrize(
    "machine, shape",
    [
        ("n2-highcpu-32", (32, 32)),
        ("n2-standard-16", (16, 64)),
        ("n2d-highmem-8", (8, 64)),
        ("e2-standard-4", (4, 16)),
        ("c2-standard-60", (60, 240)),
        ("c3-highcpu-22", (22, 44)),
        ("m1-megamem-96", (96, 1433.6)),
        ("m2-ultramem-416", (416, 11776)),
        ("a2-highgpu-1g", (12, 85)),
        ("a2-highgpu-8g", (96, 680)),
        ("a3-highgpu-8g", (208, 1872)),
        ("e2-medium", None),
        ("foo-bar-9", None),
        ("n2-custom-8-16384", None),
    ],
)
def test_planner_reads_a_machines_vcpus_and_memory_from_its_type(machine, shape):
    assert capacity_plan.machine_shape(machine) == shape


def test_planner_a_machine_of_unknown_shape_leaves_its_resources_absent_and_says_so(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert planner.main(["--params", "1e9", "--ew-machine-type", "foo-bar-9", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    s = json.loads(out.read_text())["kubeflow_settings"]
    assert s["PERSIA_K8S_EW_CPU"] is None and s["PERSIA_K8S_EW_MEMORY"] is None and s["PERSIA_K8S_PS_CPU"] == "415"
    row = next(x for x in lines if x.startswith("Kubeflow settings"))
    assert "PERSIA_K8S_EW_CPU" not in row and "PERSIA_K8S_EW_MEMORY" not in row and "PERSIA_K8S_NN_CPU=95" in row
    assert any(x.startswith("note") and "PERSIA_K8S_EW_MEMORY not derived" in x and "foo-bar-9" in x for x in lines)
    assert lines[-1] == "parameter_servers=1"
    # a parameter-server machine too small for the plan's servers is named
    p = seed_plan(ps_machine_type="m2-megamem-416")
    assert any("parameter-server pod needs" in n and "m2-megamem-416" in n for n in p.kubeflow_notes)
